"""Offline batch API: `LLM(model).generate(prompts, SamplingParams)`."""
from __future__ import annotations

from sloserve.config import EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.outputs import RequestOutput
from sloserve.sampling_params import SamplingParams


class LLM:
    """Run prompts to completion through the engine (continuous batching, chunked prefill).

    Args:
        model: GGUF file or Hugging Face folder; None = the embedded SmolLM2-135M-Instruct.
        **kwargs: any EngineConfig field (dtype, max_num_batched_tokens, scheduling_policy, ...).
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; returns the final outputs in prompt order.

        Raises:
            ParamError: a prompt or its parameters are invalid (nothing is queued then).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params")
        reqs = [self.engine.make_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        for r in reqs:
            self.engine.add(r)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r.request_id] for r in reqs]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One chat conversation through the model's chat template."""
        ids = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([ids], sampling_params)[0]
