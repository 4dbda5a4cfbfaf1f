"""lm-evaluation-harness's model interface over `LLM`: offline evaluation without a server.

    import lm_eval
    from specmoe.tools.harness import SpecMoELM

    lm = SpecMoELM(policy="caching", offload="disk", device_memory="30%", max_batch_size=32)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

Importing this module registers the model as `specmoe` for `simple_evaluate(model=
"specmoe", model_args="pretrained=DIR,policy=specmoe,...")` in the same process.

Each kind of request goes to the engine in one `LLM.generate` call, so the engine batches
them like any generation: log-likelihoods are prefill-only requests (max_tokens=0,
prompt_logprobs) whose experts are fetched once per batch of prompts; generations follow
their gen_kwargs (`until` as stop strings; greedy unless do_sample). Tokens are the
model's own without special tokens, as lm-eval's `hf` model and `local-completions`
against `specmoe serve` send them, so all three give the same numbers.
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..api import LLM
from ..base.errors import SpecMoEError
from ..engine.sampling import SamplingParams

SCORE = SamplingParams(max_tokens=0, prompt_logprobs=0)  # the rank says whether a token is the greedy one


@register_model("specmoe")
class SpecMoELM(TemplateLM):
    """`pretrained`: a model directory (None: the demo model); other keyword arguments are
    LLM's engine options (policy, offload, device_memory, max_batch_size, ...)."""

    def __init__(self, pretrained: str | None = None, **options):
        super().__init__()
        options = {k: _number(v) for k, v in options.items()}
        batch = options.pop("batch_size", None)  # lm-eval's name for it ("auto" is left to the engine)
        if isinstance(batch, int):
            options.setdefault("max_batch_size", batch)
        self.llm = LLM(model=pretrained, **options)
        if self.llm.tokenizer is None:
            raise SpecMoEError("lm-evaluation-harness needs the model's tokenizer (tokenizer.json)")
        self.max_length = self.llm.engine.max_model_len

    @property
    def eot_token_id(self) -> int:
        return self.llm.config.eos_token_ids[0]

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.llm.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        prompts, starts = [], []
        for _, context, continuation in requests:
            ids = (context + continuation)[-(self.max_length - 1):]  # cut the context from the left to fit
            prompts.append(ids)
            starts.append(len(ids) - len(continuation))
        outs = self.llm.generate(prompts, SCORE)
        answers = []
        for (key, _, _), start, out in zip(requests, starts, outs):
            scored = out.prompt_logprobs[start:]
            answer = (sum(p.logprob for p in scored), all(p.rank == 1 for p in scored))
            answers.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity: each text in windows of the context length, every token scored once."""
        totals = []
        for request in requests:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(request.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1, context_len=1)]
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            totals.append(sum(logprob for logprob, _ in scored))
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), totals[-1])
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for request in requests:
            context, gen_kwargs = request.args
            sp = sampling_params(dict(gen_kwargs))
            prompts.append(self.tok_encode(context)[-(self.max_length - sp.max_tokens):])
            params.append(sp)
        texts = [out.text for out in self.llm.generate(prompts, params)]
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts


def sampling_params(gen_kwargs: dict) -> SamplingParams:
    """lm-eval's gen_kwargs (until, max_gen_toks, do_sample, temperature, top_p, top_k) as SamplingParams."""
    until = gen_kwargs.pop("until", None) or []
    do_sample = gen_kwargs.pop("do_sample", False)
    temperature = float(gen_kwargs.pop("temperature", 0.0)) if do_sample else 0.0
    return SamplingParams(
        max_tokens=int(gen_kwargs.pop("max_gen_toks", 256)), temperature=temperature,
        top_p=float(gen_kwargs.pop("top_p", 1.0)), top_k=int(gen_kwargs.pop("top_k", 0) or 0),
        stop=[until] if isinstance(until, str) else until, seed=gen_kwargs.pop("seed", None),
    )


def _number(value):
    """model_args arrive as strings ("policy=specmoe,gamma=5"): numbers become numbers."""
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
