"""The demo snapshot's tokenizer: a small byte-level BPE trained on a built-in corpus.

Qwen-style pre-tokenisation (the split pattern is read from transformers) and the Qwen3.5
special tokens appended after the trained vocabulary, so that prompt pieces and media records
tokenize the way the serving code expects, with a vocabulary small enough to generate quickly.
"""

from __future__ import annotations

from typing import Any

# Special tokens of the Qwen3.5 tokenizer that a Clef prompt or a media record may contain, in the
# order they are appended after the trained vocabulary. (special, text)
SPECIAL_TOKENS: tuple[tuple[bool, str], ...] = (
    (True, "<|endoftext|>"),
    (True, "<|im_start|>"),
    (True, "<|im_end|>"),
    (True, "<|object_ref_start|>"),
    (True, "<|object_ref_end|>"),
    (True, "<|box_start|>"),
    (True, "<|box_end|>"),
    (True, "<|quad_start|>"),
    (True, "<|quad_end|>"),
    (True, "<|vision_start|>"),
    (True, "<|vision_end|>"),
    (True, "<|vision_pad|>"),
    (True, "<|image_pad|>"),
    (True, "<|video_pad|>"),
    (False, "<tool_call>"),
    (False, "</tool_call>"),
    (False, "<think>"),
    (False, "</think>"),
)

# The tokenizer's training text. Written for this project: the phrases a Clef prompt is made of
# (so the fixed pieces encode to few tokens, like with the real vocabulary), plus varied English,
# JSON and numbers (so client text does not fall back to single bytes everywhere).
_CORPUS: tuple[str, ...] = (
    "Read the complete state and schema. Decide every field jointly. Each answer must be exactly "
    "one of that field's allowed options.",
    "system\nuser\nassistant\nSTATE:\n\n\nSCHEMA FIELDS:\n",
    "\nFIELD 1\nID: intent\nTYPE: choice\nINSTRUCTION: What does the user want?\nALLOWED OPTIONS:\n"
    'OPTION 1: {"description":"Buy something","option_id":"buy"}\n'
    'OPTION 2: {"description":"Ask a question","option_id":"ask"}\nEND FIELD\n',
    "\nFIELD 2\nID: urgent\nTYPE: noul\nINSTRUCTION: Is the request urgent?\nALLOWED OPTIONS:\n"
    'OPTION 1: {"description":"The proposition is true or the answer is yes.",'
    '"option_id":"true"}\nOPTION 2: {"description":"The proposition is false or the answer is '
    'no.","option_id":"false"}\n'
    "END FIELD\n",
    "\nFIELD 3\nID: quality\nTYPE: score\nINSTRUCTION: Rate the quality of the answer.\n"
    'ALLOWED OPTIONS:\nOPTION 1: {"description":"poor","option_id":"0"}\n'
    'OPTION 2: {"description":"fair","option_id":"1"}\nOPTION 3: {"description":"good",'
    '"option_id":"2"}\nOPTION 4: {"description":"excellent","option_id":"3"}\nEND FIELD\n',
    "\nJOINT SCHEMA DECISIONS:",
    '{"model":"clef-flash","state":{"user":"Hello, I would like to return my order.","history":[]},'
    '"questions":{"sentiment":{"type":"choice","criteria":{"positive":"The user is happy",'
    '"negative":"The user is upset","neutral":null}}}}',
    "The customer wrote to the support team because the package arrived late and the box was "
    "damaged. They asked for a refund or a replacement, whichever is faster.",
    "A ticket is urgent when the service is down, when money was charged twice, or when the "
    "user cannot log in to their account at all.",
    "Please classify the message, decide whether it needs a human, and rate the tone from one to "
    "five. Answer with the option that fits best.",
    "The weather today is sunny with a light wind from the north; tomorrow there will be rain in "
    "the morning and clouds in the afternoon.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 15 20 25 42 50 64 100 128 255 256 1000 1024 2048 4096 "
    "3.14 0.5 -1 1e-5 2024-05-17 12:30:00",
    "true false null yes no maybe unknown none other all some every each first last next",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Is the proposition true? Does the document mention a price? Which category applies? How "
    "confident is the reviewer? Should the request be escalated?",
    "The assistant reads the state, compares it with the instructions of every field, and picks "
    "one allowed option for each field at the same time.",
    "error warning info debug request response status code message detail timeout retry limit",
    "Der Kunde möchte wissen, wann die Lieferung ankommt. Le client veut savoir quand la livraison "
    "arrive. El cliente quiere saber cuándo llega el pedido.",
)



def build_tokenizer(vocab_size: int = 1024) -> Any:
    """Train a byte-level BPE (Qwen-style pre-tokenisation) on the built-in corpus.

    The special tokens are appended after the trained vocabulary, as in the Qwen release, so that
    their text inside any prompt piece encodes to one id each.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_pretokenize_regex()), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    for special, text in SPECIAL_TOKENS:
        token = AddedToken(text, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def _pretokenize_regex() -> str:
    """The Qwen3.5 split pattern, read from transformers rather than restated here."""
    from transformers.models.qwen3_5 import tokenization_qwen3_5

    return str(tokenization_qwen3_5.PRETOKENIZE_REGEX)


def tokenizer_config() -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "backend": "tokenizers",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "image_token": "<|image_pad|>",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "TokenizersBackend",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
    }


