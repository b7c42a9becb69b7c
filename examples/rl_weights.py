"""An RL-style loop: a trainer publishes its weights after every optimizer
step; an inference process pulls them before each generation and checks that
its logits equal the trainer's, bit for bit.

    python examples/rl_weights.py            # ~110M-parameter GPT on a GPU
    python examples/rl_weights.py --tiny     # a small one (also runs on CPU)

The two processes have different layouts of the same model: the trainer keeps
q, k and v as separate matrices, the inference model one fused qkv matrix; a
name map tells the subscriber to concatenate them, inside the same batched
copy. Both compute attention with the concatenated matrix, so their logits
can match exactly.
"""
import argparse
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from torch_ipc.weights import Publisher, Subscriber

TIMEOUT = 120  # seconds


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, fused: bool):
        super().__init__()
        self.heads, self.fused = heads, fused
        if fused:
            self.qkv = nn.Linear(d, 3 * d, bias=False)
        else:
            self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        w = self.qkv.weight if self.fused else torch.cat([self.q.weight, self.k.weight, self.v.weight])
        q, k, v = F.linear(x, w).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, fused: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, fused)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int, fused: bool):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, fused) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def config(tiny: bool) -> dict:
    if tiny:
        return dict(vocab=512, d=64, layers=2, heads=4, context=64)
    return dict(vocab=16384, d=768, layers=12, heads=12, context=256)


def fused_qkv(name: str):
    """Inference name -> trainer name(s): blocks.N.attn.qkv.weight <- q, k, v."""
    if name.endswith(".attn.qkv.weight"):
        return tuple(name.replace(".qkv.", f".{part}.") for part in "qkv")
    return name


def recv(conn):
    if not conn.poll(TIMEOUT):
        raise TimeoutError("the other process did not answer")
    return conn.recv()


def prompt_for(cfg, device):
    return torch.arange(16, device=device).remainder(cfg["vocab"]).unsqueeze(0)


def trainer(attach, check, args):
    device = args.device
    cfg = config(args.tiny)
    torch.manual_seed(0)
    model = GPT(**cfg, fused=False).to(device)
    print(f"trainer: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    pub = Publisher(model)
    pub.attach(attach)  # the only message with handles; publishes send nothing
    prompt = prompt_for(cfg, device)
    for _ in range(args.steps):
        model.train()
        tokens = torch.randint(0, cfg["vocab"], (8, cfg["context"] + 1), device=device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        version = pub.publish()  # snapshot copy queued on this stream; no host wait
        publish_us = pub.stats["last_publish_us"]
        model.eval()
        with torch.no_grad():
            reference = model(prompt)[0, -1].cpu()
        check.send((version, reference, loss.item(), publish_us))
        assert recv(check) == "generated"  # on-policy: the next step waits for the rollout
    check.send(None)
    assert recv(check) == "closed"  # the subscriber let go of the shared snapshot
    pub.close()


def inference(attach, check, args):
    device = args.device
    cfg = config(args.tiny)
    torch.manual_seed(1)  # other initial weights: only pulls can make the logits match
    model = GPT(**cfg, fused=True).to(device).eval()
    sub = Subscriber(attach, name_map=fused_qkv)
    prompt = prompt_for(cfg, device)
    matches = 0
    while (message := recv(check)) is not None:
        version, reference, loss, publish_us = message
        start = time.perf_counter()
        pulled = sub.pull(into=model, newer_than=version - 1)
        if device == "cuda":
            torch.cuda.synchronize()
        pull_ms = (time.perf_counter() - start) * 1e3
        with torch.no_grad():
            logits = model(prompt)[0, -1].cpu()
            tokens = prompt
            for _ in range(8):  # greedy generation with the new weights
                tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], 1)
        same = torch.equal(logits.view(torch.int32), reference.view(torch.int32))
        matches += same
        print(f"version {pulled}: loss {loss:.3f}; publish {publish_us:.0f} us, pull {pull_ms:.2f} ms "
              f"({sub.stats['path']}, {sub.stats['launches']} launch(es)); logits "
              f"{'match the trainer bit for bit' if same else 'DIFFER from the trainer'}; "
              f"generated {tokens[0, 16:].tolist()}", flush=True)
        check.send("generated")
    sub.close()
    check.send("closed")
    print(f"inference: {matches} of {args.steps} versions matched bit for bit", flush=True)
    sys.exit(0 if matches == args.steps else 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cpu" and not args.tiny:
        print("no GPU: running the --tiny model on CPU")
        args.tiny = True
    ctx = mp.get_context("spawn")
    attach_a, attach_b = ctx.Pipe()
    check_a, check_b = ctx.Pipe()
    procs = [ctx.Process(target=trainer, args=(attach_a, check_a, args), name="trainer"),
             ctx.Process(target=inference, args=(attach_b, check_b, args), name="inference")]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT * 2
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    failed = [p for p in procs if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed:
        sys.exit(f"failed: {', '.join(f'{p.name} (exit code {p.exitcode})' for p in failed)}")
    print("done")


if __name__ == "__main__":
    main()
