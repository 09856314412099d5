"""`sam3d-objects segment`: argument handling, clear errors, and masks written in the layout that
`reconstruct --mask DIR` reads (SAM 3 itself runs in the slow test_patches_sam3.py)."""
import numpy as np
import pytest
import torch
from PIL import Image

from sam3d_objects import cli, sam3_support, segment


def test_box_parsing_and_sam3_box_convention():
    assert segment.parse_box("10,20,50,80") == [10.0, 20.0, 50.0, 80.0]
    for bad in ("10,20,50", "a,b,c,d", "50,20,10,80"):
        with pytest.raises(segment.SegmentError, match="x0,y0,x1,y1"):
            segment.parse_box(bad)
    # SAM 3's add_geometric_prompt takes a normalised (cx, cy, w, h) box
    assert segment.box_to_sam3([10, 20, 50, 80], width=100, height=200) == [0.3, 0.25, 0.4, 0.3]


def test_missing_sam3_names_the_extra(monkeypatch):
    real = sam3_support._installed  # the SAM 3 helpers segment, segment_folder and segment_video share
    monkeypatch.setattr(sam3_support, "_installed", lambda name: name != "sam3" and real(name))
    with pytest.raises(segment.SegmentError, match=r"make extras EXTRAS=sam3"):
        segment.require_sam3()


def test_missing_bpe_vocabulary_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sam3_support, "_package_dir", lambda name: None)
    with pytest.raises(segment.SegmentError, match=r"bpe_simple_vocab_16e6.txt.gz.*--bpe"):
        segment.find_bpe_vocabulary(str(tmp_path / "nope.txt.gz"))
    vocab = tmp_path / segment.BPE_NAME
    vocab.write_bytes(b"")
    assert segment.find_bpe_vocabulary(str(vocab)) == vocab


class _FakeProcessor:
    """Stands for Sam3Processor: returns fixed masks, so the writing and ordering are checked exactly."""

    def __init__(self, masks, scores):
        self.masks, self.scores, self.calls = masks, scores, []

    def set_image(self, image):
        self.size = image.size
        return {}

    def _out(self):
        return {"masks": self.masks[:, None], "scores": self.scores}

    def set_text_prompt(self, prompt, state):
        self.calls.append(("text", prompt))
        return self._out()

    def add_geometric_prompt(self, box, label, state):
        self.calls.append(("box", box, label))
        return self._out()


def test_segment_writes_masks_that_reconstruct_reads(tmp_path, monkeypatch):
    image = tmp_path / "img.png"
    Image.fromarray(np.zeros((12, 16, 3), np.uint8)).save(image)
    rng = np.random.default_rng(0)
    masks = torch.from_numpy(rng.random((3, 12, 16)) > 0.5)
    fake = _FakeProcessor(masks, torch.tensor([0.2, 0.9, 0.5]))
    monkeypatch.setattr(segment, "build_processor", lambda *a, **k: fake)
    written = segment.segment(str(image), str(tmp_path / "masks"), box="4,2,12,10")
    assert [p.name for p in written] == ["0.png", "1.png", "2.png"]
    assert fake.calls == [("box", [0.5, 0.5, 0.5, 8 / 12], True)]
    read = cli.read_masks([str(tmp_path / "masks")], (12, 16))
    assert len(read) == 3
    for (_, got), k in zip(read, [1, 2, 0]):  # by decreasing score
        np.testing.assert_array_equal(got.astype(bool), masks[k].numpy())
    segment.segment(str(image), str(tmp_path / "top"), text="chair", max_masks=1)
    assert fake.calls[-1] == ("text", "chair") and sorted(p.name for p in (tmp_path / "top").iterdir()) == ["0.png"]


def test_cli_segment_errors_are_input_errors(tmp_path, capsys):
    code = cli.main(["segment", str(tmp_path / "missing.png"), "--box", "1,2", "--out", str(tmp_path / "o")])
    assert code == cli.EXIT_INPUT
    assert "--box must be x0,y0,x1,y1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: exactly one prompt
        cli.main(["segment", "img.png", "--text", "a", "--box", "1,2,3,4", "--out", "o"])


def test_uninitialised_parameters_are_filled_and_others_kept():
    model = torch.nn.Module()
    model.garbage = torch.nn.Parameter(torch.tensor([float("nan"), 1.0]))
    model.huge = torch.nn.Parameter(torch.tensor([6e5, 0.0]))
    model.fine = torch.nn.Parameter(torch.tensor([0.5, -2.0]))
    assert segment.fill_uninitialised_parameters(model) == ["garbage", "huge"]
    assert torch.isfinite(model.garbage).all() and model.huge.abs().max() < 1.0
    assert model.fine.tolist() == [0.5, -2.0]
