"""A real session over HTTP: `python -m server serve` on a random-weight Llama saved to disk, two streamed chat turns.

The model is bench/gpu_check.py's (its shape, its seed, its one-word-per-token tokenizer with a ChatML template),
saved as safetensors in the compute dtype (bf16 on a GPU) to a scratch folder and served with the shipped
defaults. Prints the time from spawning the server to /ready (reading the weights, the Triton self-test and the
CUDA graphs' capture), what GET /v1/models/ID says about it, and per turn the prompt and cached tokens, the time
to first token and the decode rate inside the stream ((tokens - 1) / (last token's time - first's)); then the
server's own log. Turn 2 is turn 1's messages, its reply and a new question, on the same session: it must report
cached tokens (usage.prompt_tokens_details.cached_tokens), and GET /v1/sessions/ID two turns, or the run fails.
Run by bench/gpu_check.sh.

    python bench/gpu_session.py --shape 1b       # on a GPU
    python bench/gpu_session.py --shape small    # on a CPU (CI)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import StreamTimer, spawn_server
from gpu_check import SHAPES, VOCAB, random_llama, word_tokenizer

SESSION = "gpu-check"


def words(first: int, count: int, vocab: int) -> str:
    """Text of `count` tokens of the word tokenizer, from id `first` on."""
    return " ".join(f"w{7 + (first + i) % (vocab - 7)}" for i in range(count))


def chat_turn(client: httpx.Client, base: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "session_id": SESSION,
    }
    timer = StreamTimer()
    with client.stream("POST", f"{base}/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            timer.feed(line)
    return timer.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b" if torch.cuda.is_available() else "small")
    parser.add_argument("--system-tokens", type=int, help="turn 1's system prompt (1b: 1500, small: 300)")
    parser.add_argument("--max-tokens", type=int, help="tokens per reply (1b: 64, small: 16)")
    args = parser.parse_args()
    args.system_tokens = args.system_tokens or (1500 if args.shape == "1b" else 300)
    args.max_tokens = args.max_tokens or (64 if args.shape == "1b" else 16)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab = VOCAB[args.shape]
    with tempfile.TemporaryDirectory(prefix="gpu-session-") as scratch:
        model_dir = Path(scratch) / f"random-{args.shape}"
        start = time.perf_counter()
        model = random_llama(args.shape, device, dtype)
        model.save_pretrained(model_dir)
        word_tokenizer(vocab).save_pretrained(model_dir)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"model: random Llama, {args.shape} shape, {dtype}, saved in {time.perf_counter() - start:.1f} s")
        log = Path(scratch) / "server.log"
        start = time.perf_counter()
        flags = ["--model", str(model_dir), "--cache-dir", str(Path(scratch) / "cache"), "--log-level", "info"]
        proc, base = spawn_server(flags, env={"KVSERVE_STATE_DIR": ""}, log=log)  # memory only, nothing kept
        failed = False
        try:
            print(f"server ready {time.perf_counter() - start:.1f} s after its start")
            with httpx.Client(timeout=300) as client:
                (model_id,) = [m["id"] for m in client.get(f"{base}/models").json()["data"]]
                info = client.get(f"{base}/models/{model_id}").json()
                for key in ("dtype", "device", "kv_dtype", "attention", "cuda_graphs", "deterministic"):
                    print(f"  {key}: {info.get(key)}")
                messages = [
                    {"role": "system", "content": words(0, args.system_tokens, vocab)},
                    {"role": "user", "content": words(args.system_tokens, 20, vocab)},
                ]
                turns = [chat_turn(client, base, model_id, messages, args.max_tokens)]
                messages += [
                    {"role": "assistant", "content": turns[0]["text"]},
                    {"role": "user", "content": words(args.system_tokens + 20, 20, vocab)},
                ]
                turns.append(chat_turn(client, base, model_id, messages, args.max_tokens))
                record = client.get(f"{base}/sessions/{SESSION}")
                record = record.json() if record.status_code == 200 else {"status": record.status_code}
            for number, turn in enumerate(turns, 1):
                rate = turn["decode_tok_s"]
                print(
                    f"turn {number}: {turn['prompt_tokens']} prompt tokens, {turn['cached_tokens']} cached, "
                    f"{turn['completion_tokens']} out; TTFT {turn['ttft_s'] * 1000:.0f} ms, decode "
                    f"{'n/a' if rate != rate else f'{rate:.1f}'} tok/s"  # NaN: fewer than two timed pieces
                )
            device = (record.get("cache") or {}).get("device", {}).get("tokens")
            print(f"session {SESSION}: {record.get('turns')} turns, {record.get('transcript_tokens')} tokens, ", end="")
            print(f"{device} of them on the device")
            if not turns[1]["cached_tokens"]:
                print("FAILED: turn 2 found nothing of turn 1 cached")
                failed = True
            if record.get("turns") != 2:  # cached tokens alone could come from the prefix cache, not the session
                print(f"FAILED: the session lists {record.get('turns')} turns, not 2")
                failed = True
        finally:
            proc.terminate()
            proc.wait(60)
            print("server log (its /ready polls left out):")
            for line in log.read_text(errors="replace").splitlines():
                if "GET /ready" not in line:
                    print(f"  {line}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
