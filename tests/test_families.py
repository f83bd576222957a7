"""A family is one file: xdit_lab/families/<name>.py is the only place of the runtime that names it.

Adding a family is adding that file (README: Adding a family): families/__init__.py finds it, and no
other module of the runtime names a family's transformer class, its pipeline classes or its name in
its code (docstrings may, as examples). The specimens (tiny/, real_models/), the bundled digits model
and the lessons are about particular models and may name them.
"""

import ast
from pathlib import Path

from xdit_lab.families import FAMILIES, MODULES, RECIPES

PACKAGE = Path(__file__).resolve().parent.parent / "xdit_lab"
ABOUT_PARTICULAR_MODELS = ("families", "tiny", "real_models", "digits", "lessons")


def family_spellings() -> dict[str, str]:
    """{a string that names a family: the family}: its module name, its transformer and pipeline classes."""
    found = {}
    for name, module in MODULES.items():
        found[name] = found[module.ADAPTER.class_name] = name
        for pipeline in module.RECIPE.pipeline_classes if module.RECIPE else ():
            found[pipeline] = name
    return found


def code_strings(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string constant in a module's code, its docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def named_families(root: Path) -> list[str]:
    spellings = family_spellings()
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in ABOUT_PARTICULAR_MODELS:
            continue
        for line, value in code_strings(path):
            if value in spellings:
                found.append(f"{path.relative_to(root)}:{line} names {spellings[value]} ({value!r})")
    return found


def test_no_module_outside_its_file_names_a_family():
    assert not named_families(PACKAGE), "\n".join(named_families(PACKAGE))


def test_the_check_finds_a_family_named_in_code(tmp_path):
    """Control: a branch on a family's class name, the kind the families' files replaced, is found; the
    same name in a docstring is not."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "branchy.py").write_text(
        '"""Flux takes packed tokens (FluxTransformer2DModel)."""\n\n'
        "def tokens(model):\n"
        '    """For FluxTransformer2DModel: None."""\n'
        '    return None if type(model).__name__ == "FluxTransformer2DModel" else 0\n'
    )
    assert named_families(tmp_path) == ["models/branchy.py:5 names flux ('FluxTransformer2DModel')"]


def test_every_family_file_is_found_and_tabled():
    """Every file of families/ that declares an ADAPTER is a family; the tables are built from them."""
    declared = sorted(
        path.stem
        for path in (PACKAGE / "families").glob("*.py")
        if any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ADAPTER" for t in node.targets)
            for node in ast.parse(path.read_text()).body
        )
    )
    assert declared == sorted(MODULES) and len(declared) == 13
    assert {adapter.family for adapter in FAMILIES.values()} == set(MODULES)
    assert {recipe.family for recipe in RECIPES.values()} == {n for n, m in MODULES.items() if m.RECIPE}


def test_each_pipeline_class_calls_with_its_own_defaults():
    """A recipe's call defaults for each of its pipeline classes are that class's own, as its __call__'s signature
    gives them (FluxImg2ImgPipeline's guidance is 7.0, FluxPipeline's 3.5): the reference is diffusers' code."""
    import inspect

    import diffusers

    checked = 0
    for pipeline_class, recipe in RECIPES.items():
        parameters = inspect.signature(getattr(diffusers, pipeline_class).__call__).parameters
        for key, value in recipe.call_defaults(pipeline_class).items():
            if key in parameters:
                assert value == parameters[key].default, (pipeline_class, key, value, parameters[key].default)
                checked += 1
    # HunyuanVideo-1.5's guidance is its guider's, not a call argument: one default fewer for each of its two classes
    guided = [name for name in RECIPES if name.startswith("HunyuanVideo15")]
    assert checked >= 2 * len(RECIPES) - len(guided)
