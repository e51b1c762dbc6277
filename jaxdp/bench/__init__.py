"""Benchmarks: the all-reduce strategies, the train step, and jaxdp against PyTorch DDP.

    python -m jaxdp.bench collectives --devices 8 --sizes 1KB,64KB,1MB,16MB,64MB --json c.json --plot c.png
    python -m jaxdp.bench train --devices 1,8 --json t.json
    python -m jaxdp.bench train --devices 1 --coordinator-address 127.0.0.1:PORT --num-processes 2 --process-id I
    python -m jaxdp.bench ddp --json d.json        # needs torch: pip install -e '.[bench]'
    python -m jaxdp.bench gpt --json g.json        # on a GPU: bf16 GPT-2-small step, tokens/s, MFU
    python -m jaxdp.bench gpt --batch-sizes 16,32 --vs-torch --json g.json   # the same GPT in PyTorch beside it (needs torch)
    python -m jaxdp.bench slowlink --json s.json   # 2 processes over a 1gbit, 100mbit, 10mbit link (root, iproute2)
    python -m jaxdp.bench hierarchy --rate 100mbit --devices 4   # 2 processes x 4 devices: --hierarchy auto vs flat
    python -m jaxdp.bench localsgd --json l.json --plot l.png   # time to a held-out loss at 10mbit: sync vs --sync-every 16
    python -m jaxdp.bench data --size 2GB --json d.json   # a JSONL corpus tokenized once and trained on: peak memory
    python -m jaxdp.bench memory --budget-mib 64 --layers 2   # the largest GPT per device: replicated, ZeRO-1, --shard-params
    python -m jaxdp.bench quality --json q.json   # steps and seconds to a held-out loss: AdamW, Muon, outer Nesterov at one worker
    python -m jaxdp.bench budget --budget 1000x   # --byte-budget runs against synchronous float32: run lengths x seeds x models

One module per benchmark (collectives, train, gpt, ddp, slowlink, hierarchy, localsgd; torch_gpt is gpt's PyTorch side,
testbed the network namespaces slowlink runs in) says what it measures; `python -m jaxdp.bench <command> --help` lists its flags.

Method: every figure is the median over --repeats; configurations are interleaved within each
repeat, in an order that rotates from repeat to repeat, so background load hits all of them
alike. Every ratio is paired: the median over repeats (ddp: rounds) of the ratio of two cases'
times in the same repeat. Python's garbage collector is paused while timing. One "step" time is
the wall time of --steps back-to-back steps / --steps, after warm-up.
"""
