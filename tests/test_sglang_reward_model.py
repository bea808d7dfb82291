"""``task.rewards.model`` with ``kind = "score"`` against a real SGLang server of a reward model (issue 58 item 6).

SGLang serves reward models with ``--is-embedding`` behind ``/classify``, which reads ``{"text": [...]}`` and answers
``[{"embedding": [score]}, ...]``; it does not read OpenRLHF's ``{prompts, completions, query, labels}``. The server
here is SGLang 0.5.23 on CPU (the CPU route's stand-ins, ``tests/sglang_cpu``) serving a tiny random
``Qwen3ForSequenceClassification`` (one label) written with transformers. SGLang's score head has a bias the
transformers checkpoint lacks (it loads as a constant), so scores are compared with transformers' by their
differences.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from sglang_cpu import stub_env

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    """(base URL, the transformers model, its tokenizer) of a tiny reward model served by SGLang."""
    import transformers

    from _models import VOCAB, train_tokenizer

    path = tmp_path_factory.mktemp("rm") / "rm"
    tok = train_tokenizer(bos=False)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-6, head_dim=32, rope_theta=1e6, num_labels=1,
                                   pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(path.parent / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", str(path), "--is-embedding",
                             "--dtype", "float32", "--device", "cpu", "--attention-backend", "torch_native",
                             "--sampling-backend", "pytorch", "--host", "127.0.0.1", "--port", str(port),
                             "--max-total-tokens", "4096", "--log-level", "warning"],
                            env=dict(os.environ, **stub_env()), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:  # bounded by the server process: it either answers /health or exits
            assert proc.poll() is None, (path.parent / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1.0)
        yield base, model, tok
    finally:
        proc.kill()
        proc.wait(30)
        log.close()


def test_a_scoring_route_speaks_sglangs_classify_body_and_reads_its_answer(reward_server):
    from rlboost_hpc.config_task import RewardModelCfg
    from rlboost_hpc.tasks.base import Prompt
    from rlboost_hpc.tasks.reward_model import RewardModelClient, RewardModelError

    base, model, tok = reward_server
    prompt = Prompt(pid="p/0", text="What is 2+2? ", meta={"answer": "4"})
    completions = ["4", "5", "four, surely", "4"]
    rm = RewardModelClient(RewardModelCfg(url=base + "/classify", kind="score", body="sglang", score_min=-10,
                                          score_max=10, retries=0))
    got = rm.score(prompt, completions)
    with torch.no_grad():
        want = [model(**tok(prompt.text + c, return_tensors="pt")).logits.item() for c in completions]
    assert got[0] == pytest.approx(got[3], abs=1e-6)  # the same text, the same score (batch order: fp32 noise)
    assert [g - got[0] for g in got] == pytest.approx([w - want[0] for w in want], abs=1e-4), (got, want)
    # OpenRLHF's body is not what /classify reads: a failed call, never a reward
    openrlhf = RewardModelClient(RewardModelCfg(url=base + "/classify", kind="score", score_min=-10, score_max=10,
                                                retries=0))
    with pytest.raises(RewardModelError):
        openrlhf.score(prompt, completions)
    # a score outside the declared scale is a failed call
    narrow = RewardModelClient(RewardModelCfg(url=base + "/classify", kind="score", body="sglang",
                                              score_min=100, score_max=200, retries=0))
    with pytest.raises(RewardModelError, match="outside"):
        narrow.score(prompt, completions)
