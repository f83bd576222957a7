"""xdit_lab.tools.notebooks: executed notebooks are saved without widget state, and only when they ran."""

import nbformat
import pytest

from xdit_lab.tools.notebooks import WIDGET_VIEW, save_executed, strip_widgets


def test_strip_widgets_keeps_the_other_outputs():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    notebook.metadata["widgets"] = {"state": {}}
    notebook.cells[0].outputs = [
        nbformat.v4.new_output("display_data", data={WIDGET_VIEW: {}, "text/plain": "bar"}),
        nbformat.v4.new_output("stream", text="kept\n"),
    ]
    strip_widgets(notebook)
    assert "widgets" not in notebook.metadata and [o.output_type for o in notebook.cells[0].outputs] == ["stream"]


def test_save_executed_writes_outputs_and_leaves_a_failed_notebook_alone(tmp_path):
    good, bad = tmp_path / "good.ipynb", tmp_path / "bad.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")]), good)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")]), bad)
    before = bad.read_bytes()
    save_executed(good, timeout_s=120)
    assert nbformat.read(good, as_version=4).cells[0].outputs[0]["text"] == "42\n"
    with pytest.raises(Exception, match="ZeroDivisionError"):
        save_executed(bad, timeout_s=120)
    assert bad.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["bad.ipynb", "good.ipynb"]


def _sanitized(text: str) -> str:
    """`text` as nbval compares it under tutorials/nbval_sanitize.cfg (nbval's own parser, its re.sub order)."""
    from pathlib import Path

    from nbval.plugin import get_sanitize_patterns

    rules = get_sanitize_patterns((Path(__file__).parent.parent / "tutorials" / "nbval_sanitize.cfg").read_text())
    assert rules, "no rules parsed from nbval_sanitize.cfg"
    for regex, replace in rules:
        text = __import__("re").sub(regex, replace, text)
    return text


@pytest.mark.parametrize(
    "varies, blanked",
    [
        ("<object at 0x7f3a12bc>", "<object at 0xADDRESS>"),
        ("master 127.0.0.1:29500", "master 127.0.0.1:PORT"),
        ("tcp://localhost:45123", "tcp://localhost:PORT"),
        ("engine pid 12345 joined", "engine pid PID joined"),
        ("Lab (cluster '1795322427-krup', 2 ranks)", "Lab (cluster CLUSTER-ID, 2 ranks)"),
        (  # in whichever order diffusers' imports make transformers print them
            "[transformers] `SiglipImageProcessor` requires torchvision (not installed); falling back.\n"
            "[transformers] `CLIPImageProcessor` requires torchvision (not installed); falling back.\n",
            "[transformers] an image processor falls back without torchvision\n" * 2,
        ),
    ],
)
def test_the_sanitizer_blanks_what_varies(varies, blanked):
    assert _sanitized(varies) == blanked


@pytest.mark.parametrize(
    "kept",
    [
        "<Figure size 740x500 with 2 Axes>",  # a figure size is not an address
        "<PIL.Image.Image image mode=RGB size=640x64>",
        "ulysses 378.0 MiB on fast 1.32 ms",  # the link model's times are computed: checked
        "ratio 1:1000 and step 20 of 20",  # not a port
        "cfg2 speed-up 1.63x in 0.5 s",
    ],
)
def test_the_sanitizer_keeps_what_is_the_lesson(kept):
    assert _sanitized(kept) == kept
