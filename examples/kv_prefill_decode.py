"""Disaggregated prefill and decode over one shared paged KV cache.

    python examples/kv_prefill_decode.py [--device cuda|cpu] [--prompts 6] [--new-tokens 12]

The parent creates a :class:`torch_ipc.kv.SharedKVPool` and starts two
processes. The prefill process runs a small attention model over each prompt,
writes every layer's K and V into pool blocks and hands the blocks over
(``pool.send``: block ids plus the ordering signal of its stream). The decode
process takes them over (``pool.recv``: its stream waits for the prefill's
writes, the host does not), generates tokens greedily, attending over those
blocks and appending new K/V to blocks it allocates, and frees them. The parent
runs the same model in one process on a private cache of the same layout and
checks that the generated tokens and logits are identical, bit for bit.
Uses CUDA when there is a GPU, else CPU shared memory.
"""
import argparse
import math
import pickle
import sys

import torch
import torch.multiprocessing as mp

import torch_ipc
from torch_ipc.kv import SharedKVPool

TIMEOUT = 120  # seconds
VOCAB, DIM, HEADS, LAYERS, BLOCK = 256, 64, 4, 2, 8
HEAD_DIM = DIM // HEADS
BLOCK_SHAPE = (2, LAYERS, BLOCK, HEADS, HEAD_DIM)  # [k/v, layer, token in block, head, head_dim]


class TinyLM(torch.nn.Module):
    """Pre-norm transformer decoder; the same seed gives the same weights in every process."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(DIM) for _ in range(2 * LAYERS + 1))
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(DIM, 3 * DIM) for _ in range(LAYERS))
        self.out = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.mlp = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))
            for _ in range(LAYERS)
        )
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens, positions, cache):
        """Logits of the last token. `cache` gives the K/V of earlier positions
        and takes those of these tokens (layer by layer)."""
        x = self.embed(tokens) + _position_encoding(positions)
        for layer in range(LAYERS):
            q, k, v = self.qkv[layer](self.norms[2 * layer](x)).view(len(tokens), 3, HEADS, HEAD_DIM).unbind(1)
            cache.write(layer, positions, k, v)
            keys, values = cache.read(layer, int(positions[-1]) + 1)
            x = x + self.out[layer](_attend(q, keys, values, positions).reshape(len(tokens), DIM))
            x = x + self.mlp[layer](self.norms[2 * layer + 1](x))
        return self.head(self.norms[-1](x[-1]))


def _position_encoding(positions):
    freqs = torch.exp(torch.arange(0, DIM, 2, device=positions.device) * (-math.log(10000.0) / DIM))
    angles = positions[:, None].float() * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def _attend(q, keys, values, positions):
    scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(HEAD_DIM)
    causal = torch.arange(keys.shape[0], device=q.device)[None, :] > positions[:, None]
    scores = scores.masked_fill(causal[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), values)


class PagedCache:
    """One sequence's K/V in blocks of a store (a SharedKVPool, or LocalStore)."""

    def __init__(self, store, blocks=()):
        self.store = store
        self.blocks = list(blocks)

    def write(self, layer, positions, k, v):
        needed = int(positions[-1]) // BLOCK + 1
        if needed > len(self.blocks):
            self.blocks += self.store.allocate(needed - len(self.blocks))
        for pos in range(int(positions[0]), int(positions[-1]) + 1):
            i = pos - int(positions[0])
            block = self.store.block(self.blocks[pos // BLOCK])
            block[0, layer, pos % BLOCK] = k[i]
            block[1, layer, pos % BLOCK] = v[i]

    def read(self, layer, length):
        used = self.blocks[: (length - 1) // BLOCK + 1]
        kv = self.store.gather(used)[:, :, layer]  # [blocks, k/v, token, head, head_dim]
        kv = kv.transpose(0, 1).reshape(2, -1, HEADS, HEAD_DIM)[:, :length]
        return kv[0], kv[1]


class LocalStore:
    """The single-process reference's cache: a private tensor of the pool's layout."""

    def __init__(self, num_blocks, device):
        self.tensor = torch.zeros((num_blocks, *BLOCK_SHAPE), device=device)
        self.next = 0

    def allocate(self, n):
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids

    def block(self, i):
        return self.tensor[i]

    def gather(self, ids):
        return self.tensor[torch.tensor(ids, device=self.tensor.device)]


def prompts(n, device):
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(3, 4 * BLOCK, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (t,), generator=g).to(device) for t in lengths]


def model(device):
    torch.manual_seed(0)
    return TinyLM().to(device).eval()


def generate(lm, cache, first_logits, start, new_tokens):
    """Greedy decoding from the prompt's last logits; returns (tokens, stacked logits)."""
    logits, tokens, all_logits = first_logits, [], []
    for step in range(new_tokens):
        all_logits.append(logits)
        token = logits.argmax()
        tokens.append(int(token))
        positions = torch.tensor([start + step], device=logits.device)
        logits = lm(token.view(1), positions, cache)
    return tokens, torch.stack(all_logits)


def prefill_main(data, conn, device, n_prompts):
    with torch.no_grad(), SharedKVPool.attach(data, BLOCK_SHAPE, torch.float32) as pool:
        lm = model(device)
        for i, prompt in enumerate(prompts(n_prompts, device)):
            cache = PagedCache(pool)
            logits = lm(prompt, torch.arange(len(prompt), device=device), cache)
            # Block ids, this stream's ordering signal, and what decoding starts from.
            pool.send(cache.blocks, conn, meta={"prompt": i, "length": len(prompt), "logits": logits.tolist()})
        if not conn.poll(TIMEOUT):  # hold the blocks until the decoder took them over
            raise TimeoutError("the decode process did not finish")
        assert conn.recv() == "done"


def decode_main(data, conn, results, device, n_prompts, new_tokens):
    with torch.no_grad(), SharedKVPool.attach(data, BLOCK_SHAPE, torch.float32) as pool:
        lm = model(device)
        out = {}
        for _ in range(n_prompts):
            if not conn.poll(TIMEOUT):
                raise TimeoutError("the prefill process sent nothing")
            handover = pool.recv(conn)  # now ours; our stream waits for the prefill's writes
            meta = handover.meta
            cache = PagedCache(pool, handover.ids)
            logits = torch.tensor(meta["logits"], device=device)
            tokens, logits = generate(lm, cache, logits, meta["length"], new_tokens)
            out[meta["prompt"]] = (tokens, logits.cpu())
            pool.free(cache.blocks)
        conn.send("done")
        results.send_bytes(pickle.dumps(out))  # plain pickle: copies, nothing left shared


def reference(device, n_prompts, new_tokens):
    """Prefill and decode in this process, on a private cache of the same layout."""
    with torch.no_grad():
        lm = model(device)
        store = LocalStore(n_prompts * (4 + new_tokens // BLOCK + 1), device)
        out = {}
        for i, prompt in enumerate(prompts(n_prompts, device)):
            cache = PagedCache(store)
            logits = lm(prompt, torch.arange(len(prompt), device=device), cache)
            tokens, all_logits = generate(lm, cache, logits, len(prompt), new_tokens)
            out[i] = (tokens, all_logits.cpu())
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=12)
    args = parser.parse_args()
    device = args.device
    print(f"device: {device}")

    # Room for every prompt and its generated tokens at once.
    pool = SharedKVPool(args.prompts * (4 + args.new_tokens // BLOCK + 1), BLOCK_SHAPE, torch.float32, device)
    data = torch_ipc.dumps(pool)
    ctx = mp.get_context("spawn")
    prefill_end, decode_end = ctx.Pipe()
    results_in, results_out = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=prefill_main, args=(data, prefill_end, device, args.prompts), name="prefill"),
        ctx.Process(
            target=decode_main, args=(data, decode_end, results_out, device, args.prompts, args.new_tokens),
            name="decode",
        ),
    ]
    for p in procs:
        p.start()
    try:
        expected = reference(device, args.prompts, args.new_tokens)
        if not results_in.poll(TIMEOUT):
            raise TimeoutError("no result from the decode process")
        got = pickle.loads(results_in.recv_bytes())
        for p in procs:
            p.join(TIMEOUT)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    ok = all(p.exitcode == 0 for p in procs) and sorted(got) == sorted(expected)
    for i in sorted(expected):
        tokens, logits = got.get(i, ([], None))
        same = tokens == expected[i][0] and logits is not None and torch.equal(logits, expected[i][1])
        ok = ok and same
        print(f"prompt {i}: {tokens} {'matches' if same else 'DIFFERS FROM'} the single-process reference")
    print(f"blocks free again: {pool.free_blocks} of {pool.num_blocks}")
    ok = ok and pool.free_blocks == pool.num_blocks
    pool.close()
    print("OK: decode over the shared pool equals the reference, bit for bit" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
