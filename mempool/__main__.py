"""`python -m mempool`: a two-turn walk through MemPool as an engine would drive it.

It shows context caching (insert/match), tiering (swap_out/swap_in with bytes intact) and
huge-page aggregation on a real model shape.
"""

from __future__ import annotations

import argparse
import random

from mempool import KVBlockSpec, Layout, MemPool, transfer_segments

# SmolLM2-135M-Instruct, the project's tiny real model: 30 layers, 3 KV heads of 64 dims.
SMOLLM2 = KVBlockSpec(layers=30, kv_heads=3, head_dim=64, dtype="bfloat16", page_size=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--answer-tokens", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    spec = SMOLLM2
    pool = MemPool(instance_id=1, spec=spec, host_blocks=1024, device_blocks=256)
    page = spec.page_size
    print(f"MemPool instance 1: {spec.page_bytes / 2**20:.2f} MiB per {page}-token page")
    for name, tier in pool.stats()["tiers"].items():
        print(f"  {name:6} {tier['blocks']:5} blocks, backing: {tier['backing']}")

    prompt = [rng.randrange(49152) for _ in range(args.prompt_tokens)]
    answer = [rng.randrange(49152) for _ in range(args.answer_tokens)]
    turn1 = prompt + answer
    blocks = pool.alloc_blocks(-(-len(turn1) // page), "device")
    full = len(turn1) // page
    pool.insert(turn1, blocks[:full])  # the request finished: active KV becomes historical
    if blocks[full:]:
        pool.free_mem(blocks[full:])  # the partial last page is not cached
    print(f"turn 1 finished: {full * page} of {len(turn1)} tokens cached")

    turn2 = turn1 + [rng.randrange(49152) for _ in range(50)]
    hit = pool.match(turn2, lock=True)
    print(f"turn 2 arrives: {hit.num_tokens} of {len(turn2)} prompt tokens served from cache")
    pool.release(hit)

    moved = pool.swap_out(full)
    print(f"swap_out: {len(moved)} historical blocks moved to host DRAM")
    back = pool.swap_in(pool.match(turn2).addrs)
    print(f"swap_in:  {len(back)} blocks back on the device, index repointed")

    discrete = transfer_segments(spec, Layout.DISCRETE, [0] * (full * 2 * spec.layers))
    aggregated = transfer_segments(spec, Layout.AGGREGATED, [0] * full)
    print(
        f"moving this context: {len(discrete)} network calls in the discrete layout, "
        f"{len(aggregated)} aggregated ({len(discrete) // len(aggregated)}x fewer)"
    )
    stats = pool.stats()
    tiers = ", ".join(
        f"{n} {t['used']}/{t['blocks']} blocks used" for n, t in stats["tiers"].items()
    )
    print(f"cached tokens: {stats['cached_tokens']}; {tiers}")
    pool.close()


if __name__ == "__main__":
    main()
