"""``make demo`` / ``python -m sam3d_objects.demo``: the whole pipeline on the bundled example.

Reconstructs the sphere of the bundled synthetic scene (``sam3d_objects/assets/example``; its exact point map is
known, so no depth model is needed) and writes ``splat.ply``, ``mesh.glb``, ``pose.json``, ``preview.png`` and
``turntable.gif`` into ``outputs/``.

Weights: ``--checkpoints DIR``, else ``$SAM3D_CHECKPOINTS``, else ``checkpoints/hf/pipeline.yaml`` (the official
release). Without them a tiny random-weight checkpoint is generated (``checkpoints/tiny_random``) and the run is a
plumbing check: every stage executes, the result is noise; the messages before and after say so and how to get
the official weights.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from sam3d_objects import cli, errors

HF_REPO = "facebook/sam-3d-objects"
GET_WEIGHTS = f"""How to get the official weights (gated repository: accept the licence on
https://huggingface.co/{HF_REPO} first, then log in with a token that has access):

    make extras EXTRAS=hub              # huggingface_hub, pinned to keep your torch
    .venv/bin/hf auth login             # or: export HF_TOKEN=hf_...
    python -m sam3d_objects.demo --checkpoints {HF_REPO}     # downloads once into the Hugging Face cache

(or set SAM3D_CHECKPOINTS={HF_REPO}; a folder with pipeline.yaml works too). Your own images additionally need
a point map: `make extras EXTRAS=moge` installs the depth model's code (its weights, Ruicheng/moge-vitl, download
on first use), or pass one with --pointmap."""


def banner(lines: Sequence[str]) -> str:
    rule = "=" * 100
    return "\n".join([rule, *lines, rule])


def plumbing_notice(searched: str, when: str) -> str:
    if when == "before":
        head = [f"PLUMBING CHECK - no official SAM 3D Objects weights found (looked at: {searched}).",
                "This run uses a tiny RANDOM-weight checkpoint that the project generates itself. Every stage runs",
                "for real (preprocessing, both samplers, decoders, PLY/GLB export, renderer), but the weights are",
                "noise, so the 'object' you get is noise too: this checks the installation, not the model."]
    else:
        head = ["PLUMBING CHECK done - the files above come from RANDOM weights: they show that the pipeline",
                "runs end to end on this machine, not what SAM 3D Objects reconstructs."]
    return banner(head + ["", *GET_WEIGHTS.splitlines()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sam3d_objects.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default=None, help="checkpoint folder (pipeline.yaml); default: $SAM3D_CHECKPOINTS, then "
                        "checkpoints/hf, else a generated tiny random-weight checkpoint")
    p.add_argument("--out", default="outputs", help="output folder (default: outputs)")
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: cuda > mps > cpu)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--steps", default=None, help="sampling steps: N or N1,N2 (default: the yaml's)")
    p.add_argument("--object", type=int, default=0, choices=[0, 1], help="0 = sphere, 1 = box")
    p.add_argument("--turntable", type=int, default=24, metavar="FRAMES", help="turntable.gif frames (0 = none)")
    p.add_argument("--low-memory", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--tiny-dir", default=None, help="where to generate the tiny random checkpoint "
                                                    "(default: checkpoints/tiny_random)")
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args) -> int:
    from sam3d_objects.assets.example import OBJECT_NAMES, load_example
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint, is_random_checkpoint

    config, searched = cli.find_checkpoint(args.checkpoints)
    device = cli.check_device(args.device)
    steps = cli.parse_steps(args.steps)
    plumbing = config is None
    if plumbing:
        print(plumbing_notice(searched, "before"), flush=True)
        config = ensure_tiny_checkpoint(Path(args.tiny_dir) if args.tiny_dir else cli.default_tiny_dir())
    elif is_random_checkpoint(config):
        plumbing = True
        print(plumbing_notice(str(config), "before"), flush=True)
    else:
        print(f"Using the weights in {config.parent} (found via {searched}).")
        if (device or "") == "cpu" or (device is None and not _has_accelerator()):
            print("Note: no GPU here - the full-size model (about 3.2 B parameters) is slow on a CPU; "
                  "--steps 5 shortens the sampling.", flush=True)

    example = load_example()
    name = OBJECT_NAMES[args.object]
    print(f"Example: {example['folder'] / 'image.png'} ({example['image'].shape[1]}x{example['image'].shape[0]}), "
          f"object {args.object} = the {name} (mask {example['folder'] / f'{args.object}.png'}), exact point map "
          f"from the synthetic scene; seed {args.seed}.", flush=True)
    cli.reconstruct(config, example["image"], [(f"{args.object}", example["masks"][args.object])], Path(args.out),
                    pointmap=example["pointmap"], device=device, seed=args.seed, steps=steps,
                    low_memory=args.low_memory, turntable_frames=args.turntable, random_weights=plumbing,
                    progress=not args.no_progress)
    if plumbing:
        print(plumbing_notice(searched, "after"))
    return errors.EXIT_OK


def _has_accelerator() -> bool:
    import backends
    return backends.device.default_device().type != "cpu"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except errors.UserError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return errors.EXIT_INTERRUPT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
