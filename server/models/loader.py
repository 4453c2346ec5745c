"""What to serve (models.toml) and loading it: local directories, hub repos, GGUF files in packages.

A model the paged engine cannot serve (its attention does not go through transformers' attention
interface, or uses a kind the pool does not implement) is refused here, with the reason.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from server.kv.attention import unsupported_reason
from server.models.convert import converted
from server.models.digest import ModelDigests, config_digest, state_dict_digest, tokenizer_digest, weights_digest
from server.models.dtype import DtypeChoice, choose_dtype
from server.models.packed_linear import PackedLinear, can_pack, pack_linears
from server.startup import Startup

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("kvserve.registry")
KV_DTYPE_NAMES = ("auto", "compute", "int8", "fp8")  # how K/V may be stored (server/kv/pool.py)


class ModelLoadError(Exception):
    pass


@dataclass(slots=True)
class ModelSpec:
    id: str
    source: str  # a path, "hf:ORG/NAME", or "package:PKG/FILE.gguf"
    dtype: str = "auto"
    device: str = "auto"
    max_context: int | None = None
    chat_template: str | None = None  # a template string, or a file path
    kv_dtype: str | None = None  # how its K/V is stored: auto | compute | int8 | fp8 (None: the server's setting)
    base_dir: str = "."  # where relative paths in this spec start


@dataclass(slots=True)
class LoadedModel:
    spec: ModelSpec
    model: Any  # a transformers PreTrainedModel (untyped)
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_context: int
    eos_ids: frozenset[int]
    max_token_bytes: int = 64  # no token stands for more UTF-8 bytes of text: bytes / this <= tokens
    dtype_reason: str = "configured"  # why this dtype (GET /v1/models/{id} shows it)
    digests: ModelDigests | None = None  # weights, config, tokenizer: the K/V fingerprint's (None: from the model)
    guards_control_text: bool = True  # a message's text never becomes a control token (serving/control_text.py)


def read_specs(models_file: Path) -> list[ModelSpec]:
    with open(models_file, "rb") as f:
        data = tomllib.load(f)
    specs = []
    for raw in data.get("models", []):
        unknown = set(raw) - set(ModelSpec.__slots__)
        if unknown:
            raise ValueError(f"{models_file}: unknown keys {sorted(unknown)} in model {raw.get('id')!r}")
        if raw.get("kv_dtype", "auto") not in KV_DTYPE_NAMES:
            raise ValueError(f"{models_file}: kv_dtype {raw['kv_dtype']!r} in model {raw.get('id')!r} is not one of "
                             f"{', '.join(KV_DTYPE_NAMES)}")  # fmt: skip
        specs.append(ModelSpec(**raw, base_dir=str(models_file.parent)))
    if not specs:
        raise ValueError(f"{models_file}: no [[models]] entries")
    return specs


def spec_from_cli(path_or_id: str) -> ModelSpec:
    """`--model`: a local directory or GGUF file if it exists, else a hub repo id (fetched on request)."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return ModelSpec(id=path.resolve().name.removesuffix(".gguf"), source=str(path.resolve()))
    return ModelSpec(id=path_or_id, source=f"hf:{path_or_id}")


def pick_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_source(spec: ModelSpec, cache_dir: Path, startup: Startup | None = None) -> str:
    """A directory or hub id that transformers' from_pretrained can read (converting GGUF once)."""
    source = spec.source
    if source.startswith("hf:"):
        log.info("model %s: loading %s from the Hugging Face hub (or its local cache)", spec.id, source[3:])
        return source[3:]
    if source.startswith("package:"):
        gguf = _package_file(source[len("package:") :])
    else:
        gguf = Path(source).expanduser()
        if not gguf.is_absolute():
            gguf = Path(spec.base_dir) / gguf
        if not gguf.exists():
            raise FileNotFoundError(f"no such file or directory: {gguf}")
        if gguf.is_dir():
            return str(gguf)
    return str(converted(gguf, cache_dir, spec.id, startup))


def _package_file(ref: str) -> Path:
    package, _, filename = ref.partition("/")
    found = importlib.util.find_spec(package)  # locate without importing it
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"python package {package!r} is not installed (see README: make install)")
    path = Path(next(iter(found.submodule_search_locations))) / filename
    if not path.exists():
        raise FileNotFoundError(f"{filename!r} not found in package {package!r}")
    return path


def load_model(spec: ModelSpec, cache_dir: Path, startup: Startup | None = None) -> LoadedModel:
    """`startup`: what may ask the load to stop (StartupStopped at its next safe point, never a ModelLoadError)."""
    try:
        return _load(spec, cache_dir, startup or Startup())
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"model {spec.id!r} (source {spec.source}) failed to load: {exc}") from exc


def _load(spec: ModelSpec, cache_dir: Path, startup: Startup) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = pick_device(spec.device)
    where = resolve_source(spec, cache_dir, startup)
    startup.enter("load")
    config = AutoConfig.from_pretrained(where)
    choice: DtypeChoice = choose_dtype(spec.dtype, device)
    log.info("model %s: %s (%s)", spec.id, choice.name, choice.reason)
    dtype = choice.dtype
    startup.check()
    tokenizer = AutoTokenizer.from_pretrained(where)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype).to(device).eval()
    startup.check()
    reason = unsupported_reason(model)
    if reason is not None:
        raise ModelLoadError(f"model {spec.id!r} cannot be served: {reason}")
    vocab_size = model.get_output_embeddings().weight.shape[0]
    weights_dir = _weights_dir(where)  # after loading: a hub model's files are fetched by now
    weights = weights_digest(weights_dir) if weights_dir is not None else None
    if weights is None:  # no safetensors files: the parameters as loaded, before packing turns linears to buffers
        log.info("model %s: no safetensors weights; digesting the loaded parameters (not cached)", spec.id)
        weights = state_dict_digest(model)
    digests = ModelDigests(weights, config_digest(config), tokenizer_digest(tokenizer))
    startup.check()
    if can_pack(model, device, dtype):
        layers = pack_linears(model, dtype, spec.id)
        products = sum(isinstance(m, PackedLinear) for m in model.modules())
        log.info("model %s: %d linear layers packed for oneDNN as %d products", spec.id, layers, products)
    if spec.chat_template:
        tokenizer.chat_template = _read_template(spec)
    text_config = model.config.get_text_config(decoder=True)
    max_context = spec.max_context or getattr(text_config, "max_position_embeddings", None) or 2048
    return LoadedModel(
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        vocab_size=vocab_size,
        max_context=int(max_context),
        eos_ids=_eos_ids(model, tokenizer),
        max_token_bytes=_max_token_bytes(tokenizer),
        dtype_reason=choice.reason,
        digests=digests,
    )


def _weights_dir(where: str) -> Path | None:
    """The directory holding the weights: `where` itself, or a hub repo's snapshot in the local hub cache."""
    if Path(where).is_dir():
        return Path(where)
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(where, "config.json")  # no network: from_pretrained has just fetched it
    return Path(config).parent if isinstance(config, str) else None


def _read_template(spec: ModelSpec) -> str:
    template = spec.chat_template or ""
    if "{{" in template or "{%" in template:
        return template  # a template, not a path (one may be longer than a file name may be)
    return (Path(spec.base_dir) / template).read_text()


def _max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes of text one token covers. Byte-level vocabularies (GPT-2 style) write
    one character per byte; others are bounded by 4 bytes per character of their longest entry."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=16)
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return longest if type(decoder).__name__ == "ByteLevel" else 4 * longest


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)
