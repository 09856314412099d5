"""Run the golden parity harness (``check_cases.py``) with modules and inputs on an accelerator.

    python -m sam3d_objects.tools.golden_on_device --cases ../shared/golden --device cuda [--only a,b]

The harness itself runs everything on the CPU. This wrapper moves every built module and every case input to
``--device`` before the case runs (outputs come back through the harness's own ``.cpu()``), and records the
largest absolute error of each floating-point comparison, so a run prints, per case, PASS/FAIL as the harness
judges it plus the max error seen. Cases whose randomness is drawn on the device (``samplers``,
``pipeline_tiny``) cannot reproduce CPU noise: their result shows the device RNG, not a parity problem.
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
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cc = load_harness(Path(args.cases) / "check_cases.py")
    cc.setup_implementation(args.impl)
    cc._import_libraries()

    build_loaded = cc.build_loaded
    cc.build_loaded = lambda node, state_dict: build_loaded(node, state_dict).to(device)
    case_init = cc.Case.__init__

    def case_on_device(self, folder):
        case_init(self, folder)
        self.inputs = {k: v.to(device) for k, v in self.inputs.items()}
    cc.Case.__init__ = case_on_device

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
        ok = cc.run_case(folder, argparse.Namespace(verbose=False, notebook=None, impl=args.impl))
        passed += ok
        print(f"    max abs error {folder.name}: {worst.get(folder.name, float('nan')):.3g}", flush=True)
    print(f"device {device}: {passed}/{len(folders)} cases pass")
    return 0 if passed == len(folders) else 1


if __name__ == "__main__":
    sys.exit(main())
