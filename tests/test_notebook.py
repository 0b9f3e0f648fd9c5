"""notebooks/quickstart.ipynb executes top to bottom (its code cells, in order, one namespace)."""
import json
import pathlib
import re

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes():
    nb = json.loads(NOTEBOOK.read_text())
    namespace = {"__name__": "__main__"}
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(cells) >= 8
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        exec(compile(source, f"{NOTEBOOK.name}[cell {i}]", "exec"), namespace)
    assert namespace["result"].stats["generated_tokens"] > 0
    assert namespace["choices"], "the indexer choices cell found no CSA layer"


def test_every_cell_has_a_unique_id():
    """nbformat 4.5 requires cell ids (else it warns and invents them on every save)."""
    nb = json.loads(NOTEBOOK.read_text())
    assert (nb["nbformat"], nb["nbformat_minor"]) >= (4, 5)
    ids = [c.get("id") for c in nb["cells"]]
    assert all(isinstance(i, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", i) for i in ids), ids
    assert len(set(ids)) == len(ids)
