"""`sam3d-objects segment FOLDER`: auto-labelling a folder into YOLO / COCO / mask PNGs, resumable, with
previews. SAM 3 is replaced by a processor that finds coloured shapes drawn into the images, so every label written
can be compared with the shapes' true pixels (read back by pycocotools and the independent reader of
test_labels.py). SAM 3 itself runs in the slow tests."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_labels import coco_mask, iou, needs_pycocotools, parse_yolo, rasterise

from sam3d_objects import cli, segment
from sam3d_objects import segment_folder as sf

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}
H, W = 60, 80


class ColourProcessor:
    """Stands for Sam3Processor: a text prompt "red"/"blue" finds each connected blob of that colour (score from
    its size); a box prompt returns every blob of any colour, so the labeler must pick the one in the box."""

    def __init__(self, fail_on_image: int = -1):
        self.images, self.fail_on_image = 0, fail_on_image

    def set_image(self, image):
        if self.images == self.fail_on_image:
            raise KeyboardInterrupt
        self.images += 1
        return {"rgb": np.asarray(image)}

    def reset_all_prompts(self, state):
        state.pop("masks", None)

    def _out(self, state, masks):
        from scipy import ndimage

        blobs = []
        for m in masks:
            lab, n = ndimage.label(m)
            blobs += [lab == k for k in range(1, n + 1)]
        if not blobs:
            blobs_t = torch.zeros((0, 1, H, W))
        else:
            blobs_t = torch.from_numpy(np.stack(blobs)[:, None].astype(np.float32) * 0.9 + 0.05)
        boxes = []
        for b in blobs:
            r, c = np.nonzero(b)
            boxes.append([c.min(), r.min(), c.max() + 1, r.max() + 1])
        state.update(masks_logits=blobs_t, masks=blobs_t > 0.5,
                     scores=torch.tensor([0.5 + b.sum() / (2 * H * W) for b in blobs]),
                     boxes=torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4))
        return state

    def _colour(self, state, name):
        return (np.abs(state["rgb"].astype(int) - COLOURS[name]).sum(-1) < 30)

    def set_text_prompt(self, prompt, state):
        return self._out(state, [self._colour(state, prompt)])

    def add_geometric_prompt(self, box, label, state):
        return self._out(state, [self._colour(state, c) for c in COLOURS])


def make_folder(tmp_path, count=3):
    folder = tmp_path / "images"
    folder.mkdir()
    truth = {}
    rng = np.random.default_rng(0)
    for k in range(count):
        rgb = np.full((H, W, 3), 128, np.uint8)
        shapes = []
        for name, (x, y) in zip(("red", "blue"), ((5 + 3 * k, 8), (45, 20 + 2 * k))):
            yy, xx = np.mgrid[0:H, 0:W]
            mask = ((xx - x - 10) ** 2 / 100 + (yy - y - 10) ** 2 / (60 + 10 * rng.random())) <= 1
            rgb[mask] = COLOURS[name]
            shapes.append((name, mask))
        Image.fromarray(rgb).save(folder / f"img{k}.png")
        truth[f"img{k}"] = shapes
    (folder / "notes.txt").write_text("not an image")
    return folder, truth


@pytest.fixture
def fake(monkeypatch):
    proc = ColourProcessor()
    monkeypatch.setattr(segment, "build_processor", lambda *a, **k: proc)
    return proc


@needs_pycocotools
def test_folder_to_yolo_coco_and_masks(tmp_path, fake, capsys):
    from pycocotools.coco import COCO

    folder, truth = make_folder(tmp_path)
    out = tmp_path / "dataset"
    boxes = tmp_path / "boxes.csv"
    # a box around img1's blue shape, of its own class; a box on img2 whose class is also a text class
    boxes.write_text("# image,x0,y0,x1,y1,class\nimg1.png,40,15,70,50,thing\nimg2.png,0,0,35,40,red\n")
    code = cli.main(["segment", str(folder), "--text", "red", "--text", "blue", "--boxes", str(boxes),
                     "--out", str(out), "--preview", "--tolerance", "0.5"])
    assert code == cli.EXIT_OK
    printed = capsys.readouterr().out
    assert "3 image(s): 3 labelled now, 0 already done" in printed and "red: 4, blue: 3, thing: 1" in printed
    assert (out / "classes.txt").read_text() == "red\nblue\nthing\n"
    assert fake.images == 3

    coco = COCO(str(out / "annotations.json"))
    by_name = {img["file_name"]: img["id"] for img in coco.dataset["images"]}
    assert sorted(by_name) == ["img0.png", "img1.png", "img2.png"]
    for stem, shapes in truth.items():
        expected = [(cls, m) for cls, m in shapes]
        if stem == "img1":
            expected.append(("thing", shapes[1][1]))
        if stem == "img2":
            expected.append(("red", shapes[0][1]))
        # YOLO: independent parse + rasterise, class ids from classes.txt
        names = (out / "classes.txt").read_text().split()
        yolo = parse_yolo((out / "labels" / f"{stem}.txt").read_text())
        assert sorted(names[c] for c, _ in yolo) == sorted(c for c, _ in expected)
        for cls, mask in expected:
            best = max(iou(rasterise(xy * [W, H], H, W), mask) for c, xy in yolo if names[c] == cls)
            assert best > 0.9
        # COCO through pycocotools
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[by_name[f"{stem}.png"]]))
        cats = {c["id"]: c["name"] for c in coco.dataset["categories"]}
        for cls, mask in expected:
            assert max(iou(coco.annToMask(a).astype(bool), mask) for a in anns if cats[a["category_id"]] == cls) > 0.9
        # mask PNGs: exactly the shapes, by decreasing score
        pngs = sorted((out / "masks" / stem).glob("*.png"), key=lambda p: int(p.stem))
        read = [np.asarray(Image.open(p)) > 127 for p in pngs]
        assert len(read) == len(expected)
        for cls, mask in expected:
            assert any((r == mask).all() for r in read)
        assert (out / "previews" / f"{stem}.jpg").is_file()
    # the masks folder of one image is what `reconstruct --mask DIR` reads
    assert len(cli.read_masks([str(out / "masks" / "img0")], (H, W))) == 2


def test_resume_after_interrupt_and_settings_guard(tmp_path, monkeypatch, capsys):
    folder, _ = make_folder(tmp_path, count=4)
    out = tmp_path / "ds"
    proc = ColourProcessor(fail_on_image=2)
    monkeypatch.setattr(segment, "build_processor", lambda *a, **k: proc)
    args = ["segment", str(folder), "--text", "red,blue", "--out", str(out)]
    assert cli.main(args) == cli.EXIT_INTERRUPT
    assert sorted(p.name for p in (out / "records").iterdir()) == ["img0.png.json", "img1.png.json"]
    assert not list(out.rglob("*.tmp*"))  # nothing half-written
    proc.fail_on_image, proc.images = -1, 0
    assert cli.main(args) == cli.EXIT_OK
    assert proc.images == 2  # only the two images left
    assert "4 image(s): 2 labelled now, 2 already done (resumed)" in capsys.readouterr().out
    # a finished run does not load SAM 3 at all
    monkeypatch.setattr(segment, "build_processor", lambda *a, **k: pytest.fail("SAM 3 loaded"))
    assert cli.main(args) == cli.EXIT_OK
    # other settings on the same output: refused, unless --overwrite
    monkeypatch.setattr(segment, "build_processor", lambda *a, **k: proc)
    assert cli.main(args[:-2] + ["--out", str(out), "--min-area", "3"]) == cli.EXIT_INPUT
    assert "--overwrite" in capsys.readouterr().err
    proc.images = 0
    assert cli.main(args + ["--min-area", "3", "--overwrite"]) == cli.EXIT_OK and proc.images == 4


def test_unreadable_image_is_reported_and_the_rest_labelled(tmp_path, fake, capsys):
    folder, _ = make_folder(tmp_path, count=2)
    (folder / "broken.png").write_bytes(b"not a png")
    assert cli.main(["segment", str(folder), "--text", "red", "--out", str(tmp_path / "o"), "--coco-rle"]) == 0
    printed = capsys.readouterr().out
    assert "3 image(s): 2 labelled now, 0 already done (resumed), 1 failed" in printed
    assert "broken.png: cannot read the image" in printed
    doc = json.loads((tmp_path / "o" / "annotations.json").read_text())
    assert all(isinstance(a["segmentation"], dict) for a in doc["annotations"])  # RLE
    if coco_mask is not None:
        for a in doc["annotations"]:
            assert coco_mask.area(a["segmentation"]) == a["area"]


def test_boxes_file_formats_and_errors(tmp_path):
    csv_file = tmp_path / "b.csv"
    csv_file.write_text("a.png, 1, 2, 10, 20\n\n# comment\na.png,0,0,5,5,cat\n")
    assert sf.read_boxes_file(str(csv_file)) == {"a.png": [([1, 2, 10, 20], "object"), ([0, 0, 5, 5], "cat")]}
    json_file = tmp_path / "b.json"
    json_file.write_text(json.dumps({"b.jpg": [[1, 2, 3, 4, "dog"]]}))
    assert sf.read_boxes_file(str(json_file)) == {"b.jpg": [([1, 2, 3, 4], "dog")]}
    csv_file.write_text("a.png,10,2,1,20\n")
    with pytest.raises(segment.SegmentError, match="entry 1.*x1 > x0"):
        sf.read_boxes_file(str(csv_file))
    assert sf.parse_classes(["person, car", "person", "red car"]) == ["person", "car", "red car"]


def test_folder_errors_are_input_errors(tmp_path, fake, capsys):
    folder, _ = make_folder(tmp_path, count=1)
    assert cli.main(["segment", str(folder), "--out", str(tmp_path / "o")]) == cli.EXIT_INPUT
    assert "--text CLASS" in capsys.readouterr().err
    boxes = tmp_path / "b.csv"
    boxes.write_text("missing.png,1,1,5,5\n")
    assert cli.main(["segment", str(folder), "--boxes", str(boxes), "--out", str(tmp_path / "o")]) == cli.EXIT_INPUT
    assert "missing.png" in capsys.readouterr().err
    (folder / "img0.jpg").write_bytes(b"")
    assert cli.main(["segment", str(folder), "--text", "red", "--out", str(tmp_path / "o")]) == cli.EXIT_INPUT
    assert "share the label name img0.txt" in capsys.readouterr().err
