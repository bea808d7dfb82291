"""A procedural task of reasoning-gym (``task.reasoning_gym``): generated questions, scored by the generator's own
``score_answer`` — no glue code.

reasoning-gym (https://github.com/open-thought/reasoning-gym, ``pip install 'rlboost-hpc[reasoning-gym]'``)
generates question/answer entries from a seed (``create_dataset(name, size=, seed=, **config)``; entry ``i`` is a
pure function of the seed and ``i``) and scores an answer against an entry (``score_answer(answer, entry)``, in
``[0, 1]``). The run's prompts are the ``size`` entries: the last ``task.heldout_prompts`` held out, the rest trained.
A prompt is the entry's question after reasoning-gym's own default instruction (the answer inside
``<answer_tag>…</answer_tag>``, ``answer`` by default); the reward reads the completion's answer there with
reasoning-gym's ``extract_answer`` (``answer_tag = ""``: the whole completion, the prompt asking for the answer
alone). A score outside ``[0, 1]`` or a scorer that raises is a failed reward, counted by the reward pool — never a
reward.

The data set is built again in each process that needs it (the reward processes receive the task pickled, without
it): the same name, size, seed and options give the same entries.
"""
from __future__ import annotations

import math
from typing import Any

from rlboost_hpc.errors import BadInput
from rlboost_hpc.tasks.base import Prompt, Task

__all__ = ["ProceduralTask"]


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise BadInput("task.reasoning_gym needs reasoning-gym: pip install 'rlboost-hpc[reasoning-gym]'") from None
    return reasoning_gym


class ProceduralTask(Task):
    """The prompts and scorer of reasoning-gym's data set ``cfg.name`` (``cfg``: a
    :class:`~rlboost_hpc.config_task.ReasoningGymCfg`); ``n_heldout`` of its ``cfg.size`` entries held out.

    Raises:
        BadInput: reasoning-gym is not installed, the data set is unknown or refuses ``cfg.config`` (the key named).
    """

    def __init__(self, cfg: Any, n_heldout: int) -> None:
        self.cfg, self.name = cfg, f"reasoning_gym/{cfg.name}"
        self._ds = None
        ds = self._dataset()  # every refusal now, before anything heavy starts
        prompts = [self._prompt(i, ds[i]) for i in range(cfg.size)]
        self._train, self._heldout = prompts[:cfg.size - n_heldout], prompts[cfg.size - n_heldout:]

    def _dataset(self):
        if self._ds is None:
            rg = _reasoning_gym()
            try:
                self._ds = rg.create_dataset(self.cfg.name, size=self.cfg.size, seed=self.cfg.seed, **self.cfg.config)
            except ValueError as e:  # an unknown name
                from reasoning_gym.factory import DATASETS

                raise BadInput(f"task.reasoning_gym.name = {self.cfg.name!r}: {e} (known: "
                               f"{', '.join(sorted(DATASETS)[:12])}, … {len(DATASETS)} in all)") from None
            except (TypeError, AssertionError) as e:  # options its config class refuses
                raise BadInput(f"task.reasoning_gym.config = {self.cfg.config}: {type(e).__name__}: {e}") from None
        return self._ds

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ds": None}  # (built again where it is needed)

    def _prompt(self, i: int, entry: dict) -> Prompt:
        return Prompt(pid=f"{self.name}/{self.cfg.seed}/{i}", text=f"{self._instruction()}\n{entry['question']}",
                      meta={"index": i, "answer": str(entry["answer"])})

    def _instruction(self) -> str:
        """reasoning-gym's default instruction, asking for the answer inside ``answer_tag`` (its own ``answer`` by
        default); with no tag (``answer_tag = ""``: the whole completion is the answer), an instruction to answer with
        the final answer only."""
        from reasoning_gym.utils import SYSTEM_PROMPTS

        tag = self.cfg.answer_tag
        if not tag:
            return "Answer the question with the final answer only: no preamble, explanation or reasoning."
        return SYSTEM_PROMPTS["default"].replace("<answer>answer here</answer>", f"<{tag}>answer here</{tag}>")

    def train_prompts(self) -> list[Prompt]:
        return list(self._train)

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._heldout)

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """``score_answer`` of the completion's answer for the prompt's entry.

        Raises:
            ValueError: the scorer answered outside ``[0, 1]`` (counted as a failed reward by the pool).
        """
        from reasoning_gym.utils import extract_answer

        ds = self._dataset()
        answer = extract_answer(response_text, tag_name=self.cfg.answer_tag) if self.cfg.answer_tag else \
            response_text.strip()
        score = float(ds.score_answer(answer=answer, entry=ds[prompt.meta["index"]]))
        if not (math.isfinite(score) and 0.0 <= score <= 1.0):
            raise ValueError(f"reasoning-gym's {self.cfg.name} scored {score} (outside [0, 1])")
        return score

    def fingerprints(self) -> dict[str, str]:
        """What a resume checks: the generator's identity (the same name, size, seed and options give the same
        entries)."""
        c = self.cfg
        return {"task.reasoning_gym": f"{c.name}/size={c.size}/seed={c.seed}/{sorted(c.config.items())}"}

    def data_source(self, key: str) -> str | None:
        return f"reasoning-gym {self.cfg.name}" if key == "task.reasoning_gym" else None
