"""Run the golden parity harness (``check_cases.py``) with modules and inputs on an accelerator.

    python tests/tools/golden_on_device.py --cases ../shared/golden --device cuda [--only a,b] [--tf32]

A development tool, not part of the package. The harness itself runs everything on the CPU. This wrapper makes
``--device`` the default device (modules are built there, tensors the harness creates land there), moves tensor
arguments of every module call to it (case inputs stay on the CPU, where the harness also reads them with
numpy), and records the largest absolute error of each floating-point comparison; outputs come back through the
harness's own ``.cpu()``. TF32 is off unless ``--tf32`` (cuDNN enables it for convolutions by default). Cases
whose randomness is drawn on the device (``samplers``, ``pipeline_tiny``) cannot reproduce CPU noise: a
failure there shows the device RNG, not a parity problem.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch


def load_harness(path: Path):
    spec = importlib.util.spec_from_file_location("check_cases", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_cases"] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", default=None)
    p.add_argument("--impl", default=str(Path(__file__).resolve().parents[2]))
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--verbose", action="store_true", help="every comparison and tracebacks")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cc = load_harness(Path(args.cases) / "check_cases.py")
    cc.setup_implementation(args.impl)
    from patches.torchvision_shim import install  # the harness instantiates torchvision targets with plain hydra

    install()
    cc._import_libraries()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.set_default_device(device)

    def to_device(x):
        if isinstance(x, torch.Tensor) and x.device != device:
            return x.to(device)
        if hasattr(x, "feats") and hasattr(x, "coords") and hasattr(x, "to"):  # a SparseTensor
            return x.to(device) if x.feats.device != device else x
        if isinstance(x, (list, tuple)):
            return type(x)(to_device(v) for v in x)
        if isinstance(x, dict):
            return {k: to_device(v) for k, v in x.items()}
        return x

    # positional arguments only: that is how the harness calls every module
    torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: to_device(args))

    worst: dict[str, float] = {}
    close = cc.Checker.close

    def tracking_close(self, key, actual, expected=None, **kw):
        try:
            a = cc.as_tensor(actual)
            e = self.expect(key) if expected is None else expected
            if a.shape == e.shape and e.is_floating_point():
                err = (a.double() - e.double()).abs().nan_to_num(0.0)
                name = self.case.name
                worst[name] = max(worst.get(name, 0.0), float(err.max()) if err.numel() else 0.0)
        except Exception:  # the harness reports the real problem below
            pass
        return close(self, key, actual, expected, **kw)
    cc.Checker.close = tracking_close

    folders = sorted(q for q in Path(args.cases).iterdir() if (q / "case.json").is_file())
    if args.only:
        folders = [q for q in folders if q.name in set(args.only.split(","))]
    passed = 0
    for folder in folders:
        ok = cc.run_case(folder, argparse.Namespace(verbose=args.verbose, notebook=None, impl=args.impl))
        passed += ok
        print(f"    max abs error {folder.name}: {worst.get(folder.name, float('nan')):.3g}", flush=True)
    print(f"device {device}: {passed}/{len(folders)} cases pass")
    return 0 if passed == len(folders) else 1


if __name__ == "__main__":
    sys.exit(main())
