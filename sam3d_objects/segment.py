"""``sam3d-objects segment``: object masks from SAM 3 (text or box prompt), written as ``<index>.png``.

The masks folder is what ``sam3d-objects reconstruct --mask DIR`` reads. SAM 3 is optional (``make extras
EXTRAS=sam3``); it is CUDA-era code and runs here unmodified through ``patches.apply()``.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional

from sam3d_objects.sam3_support import (  # noqa: F401  re-exported: segment's public helpers
    BPE_NAME, INSTALL_HINT, SegmentError, _installed, _package_dir, box_to_sam3, fill_uninitialised_parameters,
    find_bpe_vocabulary, parse_box, require_sam3)


def build_processor(checkpoint: Optional[str] = None, bpe: Optional[str] = None,
                    confidence_threshold: float = 0.5, device: Optional[str] = None):
    """SAM 3's image model and processor; random weights without ``checkpoint`` (plumbing checks only)."""
    require_sam3()
    import patches

    patches.apply(device=device)
    import backends
    from sam3.model.sam3_image_processor import Sam3Processor
    from sam3.model_builder import build_sam3_image_model

    if checkpoint is not None and not Path(checkpoint).is_file():
        raise SegmentError(f"SAM 3 checkpoint {checkpoint} does not exist")
    target = device or str(backends.device.default_device())
    model = build_sam3_image_model(bpe_path=str(find_bpe_vocabulary(bpe)), checkpoint_path=checkpoint,
                                   load_from_HF=False, device=target)
    if checkpoint is None:
        fill_uninitialised_parameters(model)
    return Sam3Processor(model, device=target, confidence_threshold=confidence_threshold)


def segment(image_path: str, out_dir: str, text: Optional[str] = None, box: Optional[str] = None,
            checkpoint: Optional[str] = None, bpe: Optional[str] = None, confidence_threshold: float = 0.5,
            max_masks: Optional[int] = None, device: Optional[str] = None) -> List[Path]:
    """Masks for ``text`` or ``box`` on the image, by decreasing score, as ``out_dir/<index>.png`` (0/255)."""
    import numpy as np
    from PIL import Image

    if (text is None) == (box is None):
        raise SegmentError("give exactly one of --text and --box")
    corners = parse_box(box) if box is not None else None
    if not Path(image_path).is_file():
        raise SegmentError(f"image {image_path} does not exist")
    image = Image.open(image_path).convert("RGB")
    processor = build_processor(checkpoint, bpe, confidence_threshold, device)
    state = processor.set_image(image)
    if text is not None:
        state = processor.set_text_prompt(prompt=text, state=state)
    else:
        state = processor.add_geometric_prompt(box=box_to_sam3(corners, *image.size), label=True, state=state)
    order = state["scores"].argsort(descending=True).tolist()[:max_masks]
    masks = state["masks"][:, 0].cpu().numpy()
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for index, k in enumerate(order):
        path = folder / f"{index}.png"
        Image.fromarray(masks[k].astype(np.uint8) * 255).save(path)
        written.append(path)
    return written


def add_parser(sub):
    """Register ``segment`` on the CLI's subparsers."""
    seg = sub.add_parser(
        "segment", help="SAM 3 masks: one image, a folder of images (YOLO/COCO labels) or a video (per frame)",
        description=f"Segment with SAM 3 (needs `{INSTALL_HINT}`). INPUT is\n"
                    "  an image: <index>.png masks by decreasing score in --out (what `reconstruct --mask DIR` "
                    "reads);\n"
                    "  a folder of images: auto-labelling into --out (YOLO labels/ + classes.txt + data.yaml, COCO "
                    "annotations.json, masks/, --preview overlays); resumable: run the same command again;\n"
                    "  a video file, or a folder of frames with --video: a --text or --points prompt propagated "
                    "through the clip, masks/<frame>/<object id>.png (--reconstruct hands one frame to "
                    "`reconstruct`).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    seg.add_argument("input", help="image, folder of images, video file, or folder of frames (with --video)")
    prompt = seg.add_mutually_exclusive_group()
    prompt.add_argument("--text", action="append", help='what to segment, e.g. "chair"; for a folder, several '
                                                        'classes: --text person --text car (or "person,car")')
    prompt.add_argument("--box", help="one image: x0,y0,x1,y1 in pixels around the object")
    seg.add_argument("--boxes", default=None, help="folder: boxes file, lines image,x0,y0,x1,y1[,class] (pixels) "
                                                   "or JSON {\"image\": [[x0,y0,x1,y1,\"class\"], ...]}")
    seg.add_argument("--out", required=True, help="output folder")
    seg.add_argument("--checkpoint", default=None, help="SAM 3 checkpoint file (default: random weights, plumbing "
                                                         "checks only)")
    seg.add_argument("--bpe", default=None, help=f"path to {BPE_NAME} (default: found in sam3 / open_clip)")
    seg.add_argument("--threshold", type=float, default=0.5, help="confidence threshold (default 0.5)")
    seg.add_argument("--max-masks", type=int, default=None, help="one image: keep at most this many masks")
    seg.add_argument("--device", default=None, help="cpu, cuda or mps (default: cuda if available, else cpu)")
    folder = seg.add_argument_group("folder of images (auto-labelling)")
    folder.add_argument("--mask-threshold", type=float, default=0.5, help="mask probability threshold (0.5)")
    folder.add_argument("--min-area", type=int, default=16, help="drop masks / polygon parts under this many "
                                                                   "pixels (16)")
    folder.add_argument("--tolerance", type=float, default=1.0, help="polygon simplification in pixels (1.0; 0 = "
                                                                      "exact pixel outlines)")
    folder.add_argument("--coco-rle", action="store_true", help="COCO masks as compressed RLE (exact, keeps "
                                                                 "holes) instead of polygons")
    folder.add_argument("--preview", action="store_true", help="write previews/<image>.jpg overlays")
    folder.add_argument("--overwrite", action="store_true", help="redo every image (default: resume)")
    video = seg.add_argument_group("video")
    video.add_argument("--video", action="store_true", help="treat a folder INPUT as the frames of one clip")
    video.add_argument("--points", default=None, help="x,y[;x,y] pixels on --prompt-frame: one object to track "
                                                      "(instead of --text)")
    video.add_argument("--negative-points", default=None, help="x,y[;x,y] pixels not on the object")
    video.add_argument("--prompt-frame", type=int, default=0, help="frame index the prompt is given on (0)")
    video.add_argument("--max-frames", type=int, default=None, help="read at most this many frames")
    video.add_argument("--stride", type=int, default=1, help="keep every N-th frame (1)")
    video.add_argument("--reconstruct", action="store_true", help="then run `reconstruct` on one frame's masks")
    video.add_argument("--reconstruct-frame", type=int, default=None, help="that frame (default: --prompt-frame)")
    video.add_argument("--reconstruct-args", default="", help='extra reconstruct arguments, e.g. "--checkpoints '
                                                              'DIR --steps 4"')
    return seg


def _run_folder(args) -> str:
    from sam3d_objects import segment_folder as sf

    if args.box is not None:
        raise SegmentError("a folder takes --boxes FILE (boxes per image), not --box")
    classes = sf.parse_classes(args.text)
    texts = list(classes)
    boxes = sf.read_boxes_file(args.boxes) if args.boxes else {}
    for entries in boxes.values():
        for _, cls in entries:
            if cls not in classes:
                classes.append(cls)
    if not classes:
        raise SegmentError("a folder needs --text CLASS (one or more) and/or --boxes FILE")
    settings = sf.LabelSettings(classes=classes, texts=texts, threshold=args.threshold,
                                boxes_file_sha1=sf._sha1(args.boxes) if args.boxes else None,
                                mask_threshold=args.mask_threshold, min_area=args.min_area,
                                tolerance=args.tolerance, coco_format="rle" if args.coco_rle else "polygon",
                                checkpoint=args.checkpoint)

    def make_labeler():
        return sf.Sam3Labeler(build_processor(args.checkpoint, args.bpe, args.threshold, args.device),
                              mask_threshold=args.mask_threshold)

    summary = sf.label_folder(args.input, args.out, settings, boxes=boxes, preview=args.preview,
                              overwrite=args.overwrite, make_labeler=make_labeler)
    return summary.text(Path(args.out))


def _run_video(args) -> str:
    import shlex

    from sam3d_objects import segment_video as sv

    if args.box is not None or args.boxes is not None:
        raise SegmentError("a video takes --text or --points (box prompts are not wired for videos)")
    text = None
    if args.text:
        if len(args.text) > 1:
            raise SegmentError("a video takes one --text prompt")
        text = args.text[0]
    summary = sv.segment_video(args.input, args.out, text=text, points=args.points,
                               negative_points=args.negative_points, prompt_frame=args.prompt_frame,
                               checkpoint=args.checkpoint, bpe=args.bpe, device=args.device,
                               max_frames=args.max_frames, stride=args.stride)
    lines = [summary.text()]
    if args.reconstruct:
        frame = args.prompt_frame if args.reconstruct_frame is None else args.reconstruct_frame
        code = sv.reconstruct_frame(args.out, frame, shlex.split(args.reconstruct_args))
        if code != 0:
            raise SegmentError(f"reconstruct of frame {frame} failed (exit code {code})")
        lines.append(f"reconstruction of frame {frame} in {Path(args.out) / 'reconstruct'}")
    return "\n".join(lines)


def run_cli(args) -> int:
    """``sam3d-objects segment``: errors the user can fix become the CLI's input errors."""
    from sam3d_objects.errors import EXIT_OK, UserError
    from sam3d_objects.segment_video import is_video_file

    try:
        if args.checkpoint is None:
            print("NOTE: no --checkpoint: SAM 3 runs with random weights (plumbing check): the masks are noise.")
        source = Path(args.input)
        if is_video_file(args.input) or (args.video and source.is_dir()):
            print(_run_video(args))
            return EXIT_OK
        if args.points is not None or args.video:
            raise SegmentError(f"--points / --video need a video file or a folder of frames, got {args.input}")
        if source.is_dir():
            print(_run_folder(args))
            return EXIT_OK
        if args.boxes is not None:
            raise SegmentError("--boxes FILE is for a folder of images; one image takes --box x0,y0,x1,y1")
        text = None
        if args.text:
            if len(args.text) > 1:
                raise SegmentError("one image takes one --text prompt (several classes: give a folder)")
            text = args.text[0]
        written = segment(args.input, args.out, text=text, box=args.box, checkpoint=args.checkpoint,
                          bpe=args.bpe, confidence_threshold=args.threshold, max_masks=args.max_masks,
                          device=args.device)
    except SegmentError as error:
        raise UserError(str(error)) from error
    print(f"{len(written)} mask(s) written to {args.out}" + ("" if written else
          f" (none above --threshold {args.threshold})"))
    return EXIT_OK
