"""The model's tokenizer, built from the GGUF's own vocabulary and merges with the `tokenizers`
package: GPT-2 byte-level BPE behind the `smollm` pre-tokenizer (every digit on its own, then the
GPT-2 regex), control tokens (<|im_start|>, <|im_end|>, ...) as special tokens, no BOS added.
It reproduces llama.cpp's token ids (tests/test_tokenizer.py checks the reference strings)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from ..errors import OrtkvError

CONTROL = 3  # llama.cpp token type of control tokens


@dataclass
class ChatMessage:
    role: str
    content: str


class SmolTokenizer:
    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int], bos_id: int, eos_id: int,
                 chat_template: str | None = None):
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                         byte_fallback=False)
        tk = Tokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tk.decoder = decoders.ByteLevel()
        specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types) if ty == CONTROL]
        tk.add_special_tokens(specials)
        self._tk = tk
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = chat_template
        self.vocab_size = len(tokens)

    @classmethod
    def from_gguf(cls, reader) -> "SmolTokenizer":
        f = reader.fields

        def get(key, required=True):
            if key not in f:
                if required:
                    raise OrtkvError(f"the GGUF has no '{key}': its tokenizer cannot be read")
                return None
            return f[key].contents()

        try:
            return cls(get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges"), get("tokenizer.ggml.token_type"),
                       int(get("tokenizer.ggml.bos_token_id")), int(get("tokenizer.ggml.eos_token_id")),
                       get("tokenizer.chat_template", required=False))
        except OrtkvError:
            raise
        except Exception as exc:  # tokenizers raises a bare Exception on an inconsistent vocabulary
            raise OrtkvError(f"the GGUF's tokenizer cannot be built: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """ChatML as in the GGUF's template: a default system message when none is given."""
        out = []
        if not messages or messages[0].role != "system":
            out.append("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                       "<|im_end|>\n")
        for m in messages:
            out.append(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    @property
    def backend(self) -> Tokenizer:
        return self._tk
