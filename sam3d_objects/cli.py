"""``sam3d-objects``: command-line front end.

    sam3d-objects reconstruct IMAGE --mask MASK|auto [--mask MASK2 ...] --out DIR [--checkpoints DIR|ORG/NAME]
                  [--revision REV] [--device DEV] [--seed N] [--steps N | N1,N2] [--preset fast|balanced|quality]
                  [--low-memory | --no-low-memory] [--weights default|int8|bf16] [--dtype auto|bfloat16|float32]
                  [--formats gaussian,mesh]
                  [--pointmap FILE.npy | flat]
                  [--turntable [N]] [--turntable-format gif|mp4] [--texture] [--bake-views N] [--texture-size PX]
                  [--bake-steps N] [--simplify RATIO] [--fast] [--portable-seed] [--compile]
    sam3d-objects batch IMAGES_DIR --out DIR [--masks DIR|auto | --text PROMPT] [reconstruct's options]
    sam3d-objects app [--checkpoints DIR|ORG/NAME] [--host 127.0.0.1] [--port 7860] [--share]
    sam3d-objects downsample IN -o OUT (--voxel SIZE | --uniform K | --random FRACTION [--seed S] | --faces N)
    sam3d-objects backends

``reconstruct`` writes, per object, ``splat.ply`` (gaussians), ``mesh.glb``, ``pose.json`` and ``preview.png``
(``object_<i>/`` sub-folders when several masks are given, plus ``scene.ply`` with every object placed by its
pose). Progress bars follow the stages and the sampling steps; a summary of timings and peak memory ends the run.

Exit codes: 0 success, 1 internal error, 2 bad input (files, sizes, options, device, output folder), 3 checkpoint
folder missing, incomplete or corrupt, or its configuration unusable (allow-list, unknown target, missing key), 4 the
pipeline ran but could not produce an object (e.g. stage 1 found no voxel, or its values are not finite), 130
interrupted (Ctrl-C), 143 / 129 terminated (SIGTERM / SIGHUP): either way the staging folder is removed and the
objects finished before stay. ``--debug`` prints the traceback of any error. Outputs appear per object only when
complete (written into a staging folder inside --out first; one left by a killed run is removed by the next run).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from sam3d_objects.errors import (  # noqa: F401  re-exported: sam3d_objects.cli.UserError / EXIT_* stay valid
    EXIT_CHECKPOINT, EXIT_ERROR, EXIT_INPUT, EXIT_INTERRUPT, EXIT_OK, EXIT_RUN, UserError)
from sam3d_objects.pipeline.run_options import DEFAULT_SEED
# the library the subcommands share (batch and app import it too, never this module): re-exported so that
# ``from sam3d_objects.cli import reconstruct, find_checkpoint, ...`` keeps working
from sam3d_objects.reconstruction import (  # noqa: F401
    CHECKPOINT_ENV, FAST_STAGE1_STEPS, FORMATS, MAX_STEPS, MESH_EXPORTS, OFFICIAL_SUBDIR, OUTPUT_NAMES, SIGNALS,
    STAGE_ORDER, STAGING_PREFIX, TURNTABLE_FORMATS, Progress, SignalGuard, Terminated, _first_line, apply_preset,
    auto_masks, build_inference, check_checkpoint_folder, check_device, check_environment, check_finite_outputs,
    check_inputs_not_overwritten, check_out_dir, default_tiny_dir, find_checkpoint, flat_pointmap, format_summary,
    hub_checkpoint, input_warnings, parse_formats, parse_steps, pose_dict, publish, read_image, read_masks,
    read_pointmap, reconstruct, remove_stale_staging, repo_root, run_options, save_object, save_turntable,
    write_summary)


class _QuietStream:
    """stdout / stderr that stop writing, silently, once the reader went away (``| head``): the run goes on and
    its outputs are still written; Python's exit-time flush is sent to /dev/null."""

    def __init__(self, stream):
        self._stream, self._broken = stream, False

    def write(self, text):
        if self._broken:
            return len(text)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._break()
            return len(text)

    def flush(self):
        if self._broken:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._break()

    def _break(self):
        self._broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)



# caps of the options that scale work or memory (a typo of a huge value must not run until the machine swaps)
MAX_TURNTABLE_FRAMES = 720  # 2 degrees a frame at 12 fps: one minute
MAX_SEED = 2 ** 63 - 1


def _ranged_int(lo: int, hi: int, what: str) -> Callable[[str], int]:
    """argparse type: an integer in [lo, hi], refused at parse time with the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer ({what})") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give {lo}..{hi} ({what})")
        return value
    parse.__name__ = "integer"
    return parse


def _ratio(text: str) -> float:
    """argparse type of --simplify: a finite fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0.0 <= value < 1.0):
        raise argparse.ArgumentTypeError(f"{text} is out of range: give a fraction of faces to remove in [0, 1), "
                                         f"e.g. 0.95 keeps 5%")
    return value


_ratio.__name__ = "ratio"


class OneLineParser(argparse.ArgumentParser):
    """Parse errors as one line naming the option and the fix (exit 2), not the usage block."""

    def error(self, message: str):  # noqa: D401  argparse's hook
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ----------------------------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------------------------
def _add_debug(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--debug", action="store_true", default=default,
                        help="print the full traceback of every error (for bug reports)")


def add_reconstruct_parser(sub) -> argparse.ArgumentParser:
    rec = sub.add_parser("reconstruct", help="image + object mask(s) -> gaussian splat, mesh, pose",
                         description="Reconstruct each masked object of IMAGE in 3D.")
    rec.add_argument("image", help="RGB image (png/jpg)")
    rec.add_argument("--mask", action="append", required=True, metavar="MASK",
                     help="object mask (non-zero or alpha = object); repeat for several objects, or give a folder "
                          "of <index>.png masks; 'auto' = automatic foreground (alpha, else a plain background)")
    rec.add_argument("--out", required=True, help="output folder")
    rec.add_argument("--checkpoints", default=None,
                     help=f"checkpoint folder with pipeline.yaml, or a Hugging Face repo id such as "
                          f"facebook/sam-3d-objects (default: ${CHECKPOINT_ENV}, then checkpoints/hf)")
    rec.add_argument("--revision", default=None,
                     help="branch, tag or commit of a Hugging Face repo given to --checkpoints (default: main)")
    rec.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda > mps > cpu)")
    rec.add_argument("--seed", type=_ranged_int(0, MAX_SEED, "the sampling seed"), default=DEFAULT_SEED)
    rec.add_argument("--steps", default=None, help="sampling steps: N for both stages or N1,N2 (default: yaml's)")
    rec.add_argument("--low-memory", action=argparse.BooleanOptionalAction, default=None,
                     help="load each model only for its stage (default: on for CPU/MPS, off for CUDA)")
    rec.add_argument("--weights", choices=("default", "int8", "bf16"), default="default",
                     help="store the large transformers' linear weights as int8 (a quarter of their memory) or "
                          "bf16 (half; fast where the CPU has AVX-512 BF16 / AMX); default: the checkpoint's")
    rec.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                     help="what the sampling stages run in: auto = the yaml's dtype (float16 on CUDA; float32 on "
                          "CPU/MPS); bfloat16 also on the CPU (and the decoders' torsos), about 2.5x faster "
                          "sampling where it has AVX-512 BF16 / AMX, outputs differ from float32 as half-precision "
                          "CUDA runs do")
    rec.add_argument("--formats", default="gaussian,mesh", help=f"decoders to run, from {','.join(FORMATS)}")
    rec.add_argument("--pointmap", default=None,
                     help="point map .npy/.npz [H, W, 3] (PyTorch3D camera frame) instead of the depth model; "
                          "'flat' = a plane at depth 1 (plumbing checks only)")
    rec.add_argument("--turntable", type=_ranged_int(0, MAX_TURNTABLE_FRAMES, "turntable frames"), nargs="?",
                     const=36, default=0, metavar="FRAMES",
                     help="also write turntable.gif (default 36 frames)")
    rec.add_argument("--no-progress", action="store_true", help="no progress bars")
    rec.add_argument("--texture", action="store_true",
                     help="textured mesh.glb: simplify, remove interior faces, fill holes, UV-unwrap and bake the "
                          "gaussians' colours (upstream's to_glb; slow on a CPU), plus mesh_preview.png")
    rec.add_argument("--simplify", type=_ratio, default=None, metavar="RATIO",
                     help="fraction of mesh faces to remove (0.95 keeps 5%%; default 0.95 with --texture)")
    rec.add_argument("--fast", action="store_true",
                     help="upstream's fast (distilled) mode: stage 1 as a shortcut model and both stages without "
                          "classifier-free guidance, 4 stage-1 steps unless --steps says otherwise")
    rec.add_argument("--preset", choices=("fast", "balanced", "quality"), default=None,
                     help="fast: distilled mode, 4 + 4 steps; balanced: distilled, 4 + 12 steps; quality: the yaml's "
                          "defaults (25 + 25 with guidance). --steps / --fast given explicitly win")
    rec.add_argument("--turntable-format", choices=TURNTABLE_FORMATS, default="gif",
                     help="turntable.gif (Pillow) or turntable.mp4 (H.264, the `video` extra)")
    rec.add_argument("--bake-views", type=int, default=None, metavar="N",
                     help="--texture: views rendered for the bake (default 24 on CPU/MPS, 100 on CUDA)")
    rec.add_argument("--texture-size", type=int, default=None, metavar="PX",
                     help="--texture: texture size in pixels (default 1024)")
    rec.add_argument("--bake-steps", type=int, default=None, metavar="N",
                     help="--texture: optimisation steps of the bake (default 300 on CPU/MPS, 2500 on CUDA)")
    rec.add_argument("--portable-seed", action="store_true",
                     help="draw the sampling noise on the CPU so a seed gives the same object on CPU, CUDA and MPS "
                          "(default: the device's own generator, as upstream)")
    rec.add_argument("--compile", action="store_true",
                     help="torch.compile the dense models (slow first run; falls back to eager with a warning)")
    _add_debug(rec, argparse.SUPPRESS)
    rec.set_defaults(handler=_cmd_reconstruct)
    return rec


def add_backends_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("backends", help="which backend runs each op on each device, and why the others do not")
    _add_debug(parser, argparse.SUPPRESS)
    parser.set_defaults(handler=_cmd_backends)
    return parser


# one function per subcommand: a new subcommand adds its add_<name>_parser here
def add_downsample_parser(sub) -> argparse.ArgumentParser:
    from sam3d_objects.tools import downsample
    parser = downsample.add_downsample_parser(sub)
    _add_debug(parser, argparse.SUPPRESS)
    parser.set_defaults(handler=_cmd_downsample)
    return parser


def add_selfcheck_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("selfcheck", help="every op on a device vs float64 CPU references "
                                              "(python -m backends.selfcheck)")
    parser.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    _add_debug(parser, argparse.SUPPRESS)
    parser.set_defaults(handler=_cmd_selfcheck)
    return parser


def add_segment_parser(sub) -> argparse.ArgumentParser:
    from sam3d_objects import segment
    parser = segment.add_parser(sub)
    _add_debug(parser, argparse.SUPPRESS)
    parser.set_defaults(handler=_cmd_segment)
    return parser


def add_batch_parser(sub) -> argparse.ArgumentParser:
    from sam3d_objects import batch
    parser = batch.add_parser(sub)
    _add_debug(parser, argparse.SUPPRESS)
    parser.set_defaults(handler=lambda args: batch.run_cli(args))
    return parser


def add_app_parser(sub) -> argparse.ArgumentParser:
    from sam3d_objects import app
    parser = app.add_parser(sub)
    _add_debug(parser, argparse.SUPPRESS)
    parser.set_defaults(handler=lambda args: app.run_cli(args))
    return parser


SUBCOMMANDS: List[Callable[[Any], argparse.ArgumentParser]] = [add_reconstruct_parser, add_segment_parser,
                                                               add_backends_parser, add_downsample_parser,
                                                               add_selfcheck_parser, add_batch_parser,
                                                               add_app_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="sam3d-objects", description="SAM 3D Objects on CPU, MPS and CUDA.",
                                     epilog="Exit codes: 0 success, 1 internal error, 2 bad input, 3 checkpoint "
                                            "folder missing/incomplete/corrupt or its configuration unusable, 4 no "
                                            "object produced, 130 interrupted.")
    _add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _cmd_downsample(args) -> int:
    from sam3d_objects.tools.downsample import run_downsample
    try:
        return run_downsample(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise UserError(str(e)) from e


def _cmd_segment(args) -> int:
    from sam3d_objects import segment
    return segment.run_cli(args)


def _cmd_selfcheck(args) -> int:
    from sam3d_objects import selfcheck
    check_device(args.device)
    return selfcheck.main((["--device", args.device] if args.device else []) + (["--quick"] if args.quick else []))


def _cmd_backends(args) -> int:
    import backends
    print(backends.report())
    return EXIT_OK


def _cmd_reconstruct(args) -> int:
    # cheapest first, and nothing is created before every check passed: options, input files, --out, the
    # checkpoint folder (exists, every yaml and checkpoint readable), the device; then the models are built
    formats = parse_formats(args.formats)
    steps = parse_steps(args.steps)
    fast, steps = apply_preset(getattr(args, "preset", None), args.fast, steps)
    bake = bake_options(args)
    image = read_image(args.image)
    masks = auto_masks(image) if args.mask == ["auto"] else read_masks(args.mask, image.shape[:2])
    flat = args.pointmap == "flat"  # made after any downscaling: a full-size plane of a huge image costs GiBs
    pointmap = None if flat else read_pointmap(args.pointmap, image.shape[:2])
    out_dir = check_out_dir(args.out)
    check_inputs_not_overwritten([args.image, *args.mask, args.pointmap], out_dir)
    device = check_device(args.device)
    check_environment(device)
    config, source = find_checkpoint(args.checkpoints, getattr(args, "revision", None))
    if config is None:
        tiny = default_tiny_dir()
        hint = (f"--checkpoints {tiny}" if (tiny / "pipeline.yaml").is_file()
                else f"--checkpoints {tiny} after `make demo` (or `python -m sam3d_objects.demo`) created it")
        raise UserError(f"no checkpoint found (looked at {source}). Get the official weights (README: gated "
                        f"Hugging Face repo facebook/sam-3d-objects) into checkpoints/hf, or pass --checkpoints "
                        f"DIR. For a plumbing check with random weights: {hint}.", EXIT_CHECKPOINT)
    check_checkpoint_folder(config)
    image, masks, pointmap = input_warnings(image, masks, pointmap, log=lambda m: print(m, file=sys.stderr))
    if flat:
        pointmap = flat_pointmap(*image.shape[:2])
    from sam3d_objects.assets.tiny_checkpoint import is_random_checkpoint
    random_weights = is_random_checkpoint(config)
    if random_weights:
        print(f"NOTE: {config.parent} holds random weights (plumbing check): the outputs are not a reconstruction.")
    reconstruct(config, image, masks, out_dir, pointmap=pointmap, device=device, seed=args.seed,
                steps=steps, low_memory=args.low_memory, formats=formats, turntable_frames=args.turntable,
                random_weights=random_weights, progress=not args.no_progress, texture=args.texture,
                simplify=args.simplify, fast=fast, portable_seed=args.portable_seed, compile=args.compile,
                bake=bake, turntable_format=getattr(args, "turntable_format", "gif"), weights=args.weights,
                dtype=getattr(args, "dtype", "auto"))
    return EXIT_OK


def bake_options(args) -> Dict[str, Optional[int]]:
    """The texture-bake knobs given on the command line (None = the device's default, see presets)."""
    knobs = {"bake-views": getattr(args, "bake_views", None), "texture-size": getattr(args, "texture_size", None),
             "bake-steps": getattr(args, "bake_steps", None)}
    for flag, value in knobs.items():
        if value is not None and value < 1:
            raise UserError(f"--{flag} {value}: give a positive integer")
    return {"views": knobs["bake-views"], "texture_size": knobs["texture-size"], "steps": knobs["bake-steps"]}


def _print_traceback_if(debug: bool, error: BaseException) -> None:
    if debug:
        import traceback
        traceback.print_exception(error)


def main(argv: Optional[Sequence[str]] = None) -> int:
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _QuietStream(stdout), _QuietStream(stderr)
    SIGNALS.install()
    try:
        return _main(argv)
    finally:
        SIGNALS.restore()
        sys.stdout, sys.stderr = stdout, stderr


def _main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_INPUT
    try:
        code = args.handler(args)
    except (KeyboardInterrupt, Exception) as e:
        # a signal's exception is raised wherever the program is: a library's clean-up (omegaconf's, hydra's) can
        # turn it into another error on its way up, which is still the signal's doing, not the input's
        signum = SIGNALS.received()
        if signum is not None and not isinstance(e, KeyboardInterrupt):
            _print_traceback_if(args.debug, e)
            return _report_failure(SIGNALS.exception(signum), debug=False)
        return _report_failure(e, args.debug)
    signum = SIGNALS.received()
    if signum is not None:  # a library swallowed the signal's exception, or the run ended before it was re-sent
        return _report_failure(SIGNALS.exception(signum), debug=False)
    return code


def _report_failure(e: BaseException, debug: bool) -> int:
    """One line on stderr and the exit code of ``e``'s failure class (a UserError carries the code of the check
    that raised it)."""
    _print_traceback_if(debug, e)
    if isinstance(e, UserError):
        print(f"sam3d-objects: error: {e}", file=sys.stderr)
        return e.code
    if isinstance(e, KeyboardInterrupt):
        what = f"terminated by signal {e.signum}" if isinstance(e, Terminated) else "interrupted"
        print(f"sam3d-objects: {what}; completed objects (if any) are in place, nothing half-written was "
              f"left", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Terminated) else EXIT_INTERRUPT
    if isinstance(e, OSError):  # disk full, permissions changed during the run ...
        print(f"sam3d-objects: error: {type(e).__name__}: {e} (nothing half-written was left in the output "
              f"folder)", file=sys.stderr)
        return EXIT_INPUT
    # an internal failure: the traceback (with --debug) is for a bug report
    print(f"sam3d-objects: internal error: {type(e).__name__}: {_first_line(e)} (rerun with --debug for the "
          f"traceback and report it with the command line)", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
