"""Reader of Hugging Face model directories (``config.json`` + safetensors or ``.bin`` files).

The weights are read by the registered ``safetensors`` and ``torch`` readers (looked up in the
format registry, so this package imports no other format package); this reader adds the
config: ``metadata().common`` holds the architecture and a summary of the model's size,
``extras["config"]`` the whole ``config.json``. safetensors wins when a directory has both
(as transformers does). A ``.bin`` index naming a missing file, or a tensor stored twice, is a
CorruptCheckpointError.

A quantized release (``quantization_config`` in config.json: block-scaled FP8, MXFP4) is seen
dequantized (:mod:`.quant_view`): each weight and its scales make one tensor of the model's
dtype; ``extras["quantization"]`` summarises the stored form. Unknown quantization methods and
missing or misshapen scales are refused when the metadata is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, InputError
from ckpt_tool.formats.base import Format, Reader, formats, register
from ckpt_tool.model import CheckpointMeta, TensorMeta

__all__ = ["HfReader", "HF", "CONFIG", "read_config", "weight_kind"]

CONFIG = "config.json"
BIN_INDEX = "pytorch_model.bin.index.json"
_SUMMARY = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
            "num_attention_heads", "num_key_value_heads", "vocab_size",
            "tie_word_embeddings", "num_local_experts", "num_experts", "dtype", "torch_dtype")


def weight_kind(d: Path) -> str | None:
    """``"safetensors"``, ``"bin"`` or None for what weights directory ``d`` holds."""
    if any(d.glob("*.safetensors")) or any(d.glob("*.safetensors.index.json")):
        return "safetensors"
    if (d / BIN_INDEX).is_file() or any(d.glob("pytorch_model*.bin")):
        return "bin"
    return None


def sniff(path: Path) -> str | None:
    """A directory with ``config.json`` and safetensors or ``pytorch_model*.bin`` weights."""
    if not path.is_dir():
        return "not a directory"
    if not (path / CONFIG).is_file():
        return f"no {CONFIG}"
    if weight_kind(path) is None:
        return f"{CONFIG} but no *.safetensors or pytorch_model*.bin weights"
    return None


def read_config(path: Path) -> dict[str, Any]:
    """The parsed ``config.json`` (a file or the directory holding it)."""
    f = path / CONFIG if path.is_dir() else path
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError("no such file", path=f, hint="check the path") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"not valid JSON ({exc})", path=f) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError("not a JSON object", path=f)
    return doc


class HfReader(Reader):
    """See the module docstring."""

    format_name = "hf"

    def __init__(self, path: Path, *, trust: bool = False):
        super().__init__(path, trust=trust)
        self.root = self.path
        self.config = read_config(self.path)
        self.kind = weight_kind(self.path)
        self._parts: list[Reader] = []
        self._owner: dict[str, Reader] = {}
        self._meta: CheckpointMeta | None = None
        self._quant: Any = None  # a quant_view.QuantView for a quantized release

    def _bin_files(self) -> tuple[list[str], str | None]:
        index = self.path / BIN_INDEX
        if not index.is_file():
            return sorted(p.name for p in self.path.glob("pytorch_model*.bin")), None
        try:
            wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(map(str, wmap.values())))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{BIN_INDEX} has no valid weight_map ({exc!r})",
                                         path=self.path) from None
        for name in files:
            if not (self.path / name).is_file():
                raise CorruptCheckpointError(f"{BIN_INDEX} names {name}, which is missing",
                                             path=self.path, hint="copy the missing shard")
        return files, BIN_INDEX

    def metadata(self) -> CheckpointMeta:
        """The tensors of every weight file, the architecture and the config."""
        if self._meta is not None:
            return self._meta
        registry = formats()
        tensors: dict[str, TensorMeta] = {}
        extras: dict[str, Any] = {"config": self.config, "weights": self.kind}
        if self.kind == "safetensors":
            sub = registry["safetensors"].open(self.path, trust=self.trust)
            self._parts.append(sub)
            m = sub.metadata()
            tensors.update(m.tensors)
            self._owner.update(dict.fromkeys(m.tensors, sub))
            extras.update({k: m.extras[k] for k in ("files", "index") if k in m.extras})
        else:
            files, index = self._bin_files()
            for name in files:
                sub = registry["torch"].open(self.path / name, trust=self.trust)
                self._parts.append(sub)
                for key, t in sub.metadata().tensors.items():
                    if key in tensors:
                        raise CorruptCheckpointError(
                            f"tensor {key!r} is stored in {tensors[key].chunks[0].file} and "
                            f"{name}", path=self.path)
                    tensors[key] = t
                    self._owner[key] = sub
            extras.update(files=files, index=index)
        from ckpt_tool.formats.hf.quant_view import QuantView, model_dtype, scheme_of

        scheme = scheme_of(self.config, self.path / CONFIG)
        if scheme is not None:  # a quantized release: its dequantized tensors
            self._quant = QuantView(scheme, tensors, model_dtype(self.config), self._read_stored,
                                    self.path)
            tensors = self._quant.tensors
            extras["quantization"] = self._quant.summary()
        arch = ", ".join(self.config.get("architectures") or ()) or \
            str(self.config.get("model_type") or "unknown")
        common = {"architecture": arch,
                  "model": {k: self.config[k] for k in _SUMMARY if k in self.config}}
        if self._quant is not None:
            common["quantization"] = self._quant.describe()
        self._meta = CheckpointMeta(format=self.format_name, root=str(self.path),
                                    tensors=tensors, common=common, extras=extras)
        return self._meta

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """Tensor ``key`` (or ``slices`` of it), read by the file's own reader (a quantized
        weight dequantized, a slab at a time)."""
        self.metadata()
        if self._quant is not None and key in self._quant.pairs:
            return self._quant.read(key, slices)
        return self._read_stored(key, slices)

    def _read_stored(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        owner = self._owner.get(key)
        if owner is None:
            raise InputError(f"no tensor {key!r} in the model directory", path=self.path)
        return owner.read(key, slices)

    def common(self) -> dict[str, Any]:
        """``{"config": config.json}``."""
        return {"config": self.config}

    def close(self) -> None:
        """Close the weight files' readers."""
        for p in self._parts:
            p.close()


HF = register(Format(
    name="hf", sniff=sniff, open=HfReader,
    description="Hugging Face model directory: config.json + safetensors or "
                "pytorch_model*.bin (+ index)"))
