"""xdit_lab.tools.notebooks: executed notebooks are saved without widget state, and only when they ran."""

import nbformat
import pytest

from xdit_lab.tools.notebooks import WIDGET_VIEW, save_executed, strip_widgets


def test_strip_widgets_keeps_the_other_outputs():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    notebook.metadata["widgets"] = {"state": {}}
    notebook.cells[0].outputs = [nbformat.v4.new_output("display_data", data={WIDGET_VIEW: {}, "text/plain": "bar"}),
                                 nbformat.v4.new_output("stream", text="kept\n")]
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
