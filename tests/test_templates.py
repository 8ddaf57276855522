"""Templates and metadata are data, not code.

- Chat templates from GGUF metadata and from tokenizer files that reach for Python
  internals are refused when the tokenizer loads, in one line naming the file; names
  built at run time are refused by the sandbox transformers renders templates in (checked
  here to be jinja2's ImmutableSandboxedEnvironment). A canary file that the templates try
  to create never appears.
- Nothing is unpickled and no checkpoint code runs: a source scan of the library, and
  models or tokenizers that ask for their own code (``auto_map``) next to code that would
  leave a canary if imported.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jinja2
import pytest

import specjax

from specjax.checkpoints_tools.gguf_loader import load_gguf
from specjax.checkpoints_tools.gguf_reader import read_gguf
from specjax.checkpoints_tools.hf import (HUB_PATTERNS, check_chat_template, load_hf_directory,
                                          load_hf_tokenizer)
from specjax.errors import CheckpointError, InvalidArgumentError

from conftest import tiny_pair

ROOT = Path(__file__).resolve().parent.parent
CANARY = "specjax-template-canary"

# Each would run Python if rendered outside a sandbox; CANARY marks the ones that would
# create a file.
HOSTILE = {
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "cycler globals": "{{ cycler.__init__.__globals__.os.system('touch " + CANARY + "') }}",
    "joiner builtins": "{{ joiner.__init__.__globals__['__builtins__']['open']('" + CANARY
                       + "', 'w') }}",
    "attr filter": "{{ (messages | attr('__class__')).__base__ }}",
    "dunder item": "{% for m in messages %}{{ m['__class__'] }}{% endfor %}",
    "private attribute": "{{ self._TemplateReference__context }}",
    "namespace init": "{% set ns = namespace() %}{{ ns.__init__.__globals__ }}",
}
# Valid templates that must keep loading: the tiny one, transformers' generation tag, a
# dict key that starts with an underscore.
BENIGN = [
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "{% for m in messages %}{{ m['_meta'] | default('') }}{% break %}{% endfor %}",
]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where CANARY would appear
    yield
    assert not (tmp_path / CANARY).exists(), "a template ran code"


def write_gguf(path: Path, template: str) -> Path:
    """A GGUF file with llama metadata, the tiny tokenizer and ``template`` (no tensors: the
    tokenizer, and so the template, is checked before the weights)."""
    import gguf

    from helpers_checkpoints import tiny_vocabulary

    tokens, types, merges = tiny_vocabulary()
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 2), (writer.add_layer_norm_rms_eps, 1e-6)]:
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_tokenizer(template: str | None):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                   chat_template=template)


def one_line_error(call, *args, naming: str) -> str:
    with pytest.raises(CheckpointError) as info:
        call(*args)
    message = str(info.value)
    assert "\n" not in message and naming in message, message
    return message


# ----------------------------------------------------------------------------- rendering


def test_transformers_renders_chat_templates_in_an_immutable_sandbox():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template("{{ messages[0]['content'] }}")
    assert isinstance(compiled.environment, ImmutableSandboxedEnvironment)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_gguf_template_is_refused_when_the_file_loads(tmp_path, name):
    path = write_gguf(tmp_path / "hostile.gguf", HOSTILE[name])
    message = one_line_error(load_gguf, path, naming=str(path))
    assert "tokenizer.chat_template" in message and "Python internal" in message


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_tokenizer_file_template_is_refused_when_it_loads(tmp_path, name):
    directory = tmp_path / "tok"
    tiny_tokenizer(HOSTILE[name]).save_pretrained(directory)
    assert (directory / "chat_template.jinja").is_file()
    message = one_line_error(load_hf_tokenizer, directory, naming=str(directory))
    assert "chat template" in message and "Python internal" in message


def test_template_in_tokenizer_config_json_is_checked_too(tmp_path):
    directory = tmp_path / "tok"
    tiny_tokenizer(None).save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": BENIGN[0]},
                               {"name": "tool_use", "template": HOSTILE["cycler globals"]}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    message = one_line_error(load_hf_tokenizer, directory, naming=str(directory))
    assert "'tool_use'" in message


def test_names_built_at_run_time_are_refused_by_the_sandbox(tmp_path):
    # the load-time check cannot see a computed name; the sandbox refuses it on render
    template = "{{ cycler['__in' ~ 'it__']['__glob' ~ 'als__'].os.system('touch " + CANARY + "') }}"
    check_chat_template(template, "runtime")
    directory = tmp_path / "tok"
    tiny_tokenizer(template).save_pretrained(directory)
    tokenizer = load_hf_tokenizer(directory)
    with pytest.raises(jinja2.exceptions.SecurityError) as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False)
    assert "\n" not in str(info.value)
    # Through the API, the refusal is specjax's one-line error naming the model.
    model = dataclasses.replace(tiny_pair("llama-gqa")[1], tokenizer=tokenizer, name="hostile")
    with pytest.raises(InvalidArgumentError, match="'hostile': its chat template failed") \
            as info:
        specjax.generate(model, "hi", chat=True, max_new_tokens=1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("template", BENIGN)
def test_benign_templates_load_and_render(tmp_path, template):
    check_chat_template(template, "benign")
    directory = tmp_path / "tok"
    tiny_tokenizer(template).save_pretrained(directory)
    tokenizer = load_hf_tokenizer(directory)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a b"}], tokenize=False)
    assert isinstance(text, str)


def test_shipped_model_template_passes_the_check():
    from specjax.checkpoints_tools.sources import known_model_path

    path = known_model_path("smollm2-135m")
    template = read_gguf(path).fields["tokenizer.chat_template"]
    assert "{%" in template
    check_chat_template(template, str(path))


def test_a_template_that_is_not_text_is_refused():
    for value in (7, ["{{ x }}"], None):
        with pytest.raises(CheckpointError, match=r"^src is \w+, not a string$"):
            check_chat_template(value, "src")


# ----------------------------------------------------------------------------- no code


def _library_sources() -> list[Path]:
    return sorted(p for folder in ("specjax", "checkpoints_tools", "kernels")
                  for p in (ROOT / folder).rglob("*.py"))


def _keyword(call: ast.Call, name: str):
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return None


def _dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def test_the_library_never_unpickles_or_runs_checkpoint_code():
    problems = []
    for file in _library_sources():
        tree = ast.parse(file.read_text(), str(file))
        for node in ast.walk(tree):
            where = f"{file.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + [getattr(node, "module", "")]
                banned = {"pickle", "cPickle", "_pickle", "dill", "joblib", "marshal",
                          "shelve", "cloudpickle"}
                if any((name or "").split(".")[0] in banned for name in names):
                    problems.append(f"{where}: imports {names}")
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            if name in ("np.load", "numpy.load"):  # numpy's default is allow_pickle=False
                value = _keyword(node, "allow_pickle")
                if value is not None and not (isinstance(value, ast.Constant)
                                              and value.value is False):
                    problems.append(f"{where}: {name} with allow_pickle other than False")
            if name.endswith("torch.load"):
                value = _keyword(node, "weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    problems.append(f"{where}: torch.load without weights_only=True")
            value = _keyword(node, "trust_remote_code")
            if value is not None and not (isinstance(value, ast.Constant) and value.value is False):
                problems.append(f"{where}: trust_remote_code is not False")
            if name in ("eval", "exec"):
                problems.append(f"{where}: calls {name}")
    assert not problems, problems


def test_hub_downloads_never_include_python_files():
    for name in ("modeling_x.py", "configuration_x.py", "tokenization_x.py", "sub/x.py"):
        assert not any(fnmatch.fnmatch(name, pattern) for pattern in HUB_PATTERNS), name


def _plant_code(directory: Path, module: str) -> None:
    """A module that would create CANARY (in the working directory) when imported."""
    (directory / f"{module}.py").write_text(
        f"from pathlib import Path\nPath({CANARY!r}).touch()\n")


@pytest.fixture
def no_prompt(monkeypatch):
    """Fails the test if anything asks on the terminal (transformers asks whether to run a
    checkpoint's code when trust_remote_code is left unset); the answer given is "no"."""
    asked = []

    def answer(prompt=""):
        asked.append(prompt)
        return "n"

    monkeypatch.setattr("builtins.input", answer)
    yield
    assert not asked, asked


def test_model_that_needs_its_own_code_is_refused_saying_why(tmp_path, no_prompt):
    from helpers_checkpoints import save_tiny, tiny_model

    directory = save_tiny(tiny_model("llama-mha-tied"), tmp_path / "custom")
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config))
    _plant_code(directory, "configuration_evil")
    _plant_code(directory, "modeling_evil")
    message = one_line_error(load_hf_directory, directory, naming=str(directory / "config.json"))
    assert "needs its own Python code" in message and "trust_remote_code" in message


def test_tokenizer_that_asks_for_its_own_code_never_runs_it(tmp_path, no_prompt):
    directory = tmp_path / "tok"
    tiny_tokenizer(None).save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config["tokenizer_class"] = "EvilTokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    _plant_code(directory, "tokenization_evil")
    message = one_line_error(load_hf_tokenizer, directory, naming=str(directory))
    assert "needs its own Python code" in message and "trust_remote_code" in message
