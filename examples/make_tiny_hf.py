"""A tiny Hugging Face chat model to try the trainer on, built offline: a random 2-layer Llama
and a byte-level tokenizer (every UTF-8 byte a token, so any text encodes) with a chat template,
saved with ``save_pretrained`` into one folder, as a model downloaded from the Hub would be.

    python examples/make_tiny_hf.py runs/tiny-llama
    python examples/make_tiny_hf.py runs/tiny-llama --chat examples/data/chat.jsonl   # and the data

``--chat FILE`` also writes a JSON Lines file of short conversations (sums of two small numbers)
in the ``messages`` form that ``data.format = "chat"`` reads."""
import argparse
import json
import os
import random

SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    byte = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}   # the 256 byte symbols
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = byte, decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    return fast


def model(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def conversations(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        yield {"messages": [{"role": "user", "content": f"{a}+{b}="},
                            {"role": "assistant", "content": str(a + b)}]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the folder to write (config.json, model.safetensors, tokenizer files)")
    ap.add_argument("--chat", help="also write this many conversations to this JSON Lines file", default=None)
    ap.add_argument("--records", type=int, default=2000)
    args = ap.parse_args()
    tok = tokenizer()
    os.makedirs(args.out, exist_ok=True)
    tok.save_pretrained(args.out)
    model(len(tok)).save_pretrained(args.out)
    print(f"{args.out}: a 2-layer Llama and its tokenizer ({len(tok)} tokens, with a chat template)")
    if args.chat:
        os.makedirs(os.path.dirname(os.path.abspath(args.chat)), exist_ok=True)
        with open(args.chat, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in conversations(args.records))
        print(f"{args.chat}: {args.records} conversations")


if __name__ == "__main__":
    main()
