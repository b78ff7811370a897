"""The library examples in the docstrings and README run as written."""
import os
import re

import comfy_modelopt
from comfy_modelopt import calibrate as calibrate_mod


def _example(doc: str) -> str:
    """The indented block after 'Example ...::' in a docstring."""
    block = doc.split("::", 1)[1]
    lines = [line for line in block.splitlines()]
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines)


def _run_in(folder, code: str, name: str) -> None:
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(code, name, "exec"), {})
    finally:
        os.chdir(cwd)


def test_calibrate_docstring_example_runs(tmp_path, capsys):
    _run_in(tmp_path, _example(calibrate_mod.calibrate.__doc__), "calibrate-example")
    out = capsys.readouterr().out
    assert "format: float8_e4m3fn" in out and "layers: 2 quantized" in out
    assert "weight-only" not in out  # the statistics gave every layer a static input scale
    assert (tmp_path / "stats.safetensors").exists()


def test_readme_library_example_runs(tmp_path, flux_file, capsys):
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    code = re.search(r"```python\n(.*?)```", readme.split("## Library", 1)[1], re.S).group(1)
    code = code.replace("flux1-dev.safetensors", flux_file).replace("flux1-dev-fp8.safetensors",
                                                                     str(tmp_path / "out.safetensors"))
    exec(compile(code, "readme-example", "exec"), {})
    assert (tmp_path / "out.safetensors").exists()
    assert "quantized" in capsys.readouterr().out
    assert comfy_modelopt.quantize_file.__doc__


def test_readme_module_example_runs(tmp_path, capsys):
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", readme.split("## Library", 1)[1].split("\n## ", 1)[0], re.S)
    code = [b for b in blocks if "quantize_module" in b][0]
    code = "\n".join(line[2:] if line.startswith("  ") else line for line in code.splitlines())
    _run_in(tmp_path, code, "readme-module-example")
    err = float(capsys.readouterr().out.strip().split("(")[1].split(")")[0])
    assert 0 < err < 0.05
    assert (tmp_path / "mlp-fp8.safetensors").exists()  # not the CLI example's name: pasted in order, both run
