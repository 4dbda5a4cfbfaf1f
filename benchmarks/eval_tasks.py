"""Two small lm-evaluation-harness tasks built from the held-out Python docs, offline.

- `pydoc_mc` (multiple choice, scored by log-likelihood): the opening words of a
  paragraph; which of four continuations is the paragraph's own? The three others are
  the same number of words from other paragraphs. Metrics: acc, acc_norm.
- `pydoc_gen` (generation): the opening words of a paragraph, continued greedily up to
  a newline; exact match with the paragraph's next words, as a smoke metric.

    python benchmarks/eval_tasks.py OUTDIR [--questions 200] [--generations 50]
    lm_eval --model local-completions --model_args base_url=http://127.0.0.1:8000/v1/completions,model=specmoe-demo \
        --tasks pydoc_mc,pydoc_gen --include_path OUTDIR

The tasks are deterministic (a fixed seed) so every run and every model sees the same questions.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HELDOUT = Path(__file__).parent / "prompts" / "heldout.jsonl"
CONTEXT_WORDS, ANSWER_WORDS, CHOICES = 12, 4, 4

MC_TASK = """task: pydoc_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_TASK = """task: pydoc_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def paragraphs(path: Path = HELDOUT) -> list[list[str]]:
    """The words of each held-out paragraph long enough to ask about."""
    out = []
    for line in path.read_text().splitlines():
        words = json.loads(line)["prompt"].split()
        if len(words) >= CONTEXT_WORDS + ANSWER_WORDS:
            out.append(words)
    return out


def multiple_choice(paras: list[list[str]], n: int, rng: random.Random) -> list[dict]:
    docs = []
    for words in paras[:n]:
        answer = " ".join(words[CONTEXT_WORDS:CONTEXT_WORDS + ANSWER_WORDS])
        others = [p for p in rng.sample(paras, CHOICES + 2) if p is not words]
        distractors = [" ".join(p[CONTEXT_WORDS:CONTEXT_WORDS + ANSWER_WORDS]) for p in others[:CHOICES - 1]]
        gold = rng.randrange(CHOICES)
        choices = distractors[:gold] + [answer] + distractors[gold:]
        docs.append({"context": " ".join(words[:CONTEXT_WORDS]), "choices": choices, "gold": gold})
    return docs


def generation(paras: list[list[str]], n: int) -> list[dict]:
    return [{"context": " ".join(w[:CONTEXT_WORDS]), "answer": " ".join(w[CONTEXT_WORDS:CONTEXT_WORDS + ANSWER_WORDS])}
            for w in paras[-n:]]


def write_tasks(out: Path, questions: int = 200, generations: int = 50, max_gen_toks: int = 16) -> Path:
    """Write pydoc_mc.yaml, pydoc_gen.yaml and their data under `out`; return `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paras = paragraphs()
    if questions + generations > len(paras):
        raise SystemExit(f"the held-out docs have {len(paras)} usable paragraphs; ask for fewer questions")
    rng = random.Random(0)
    for name, docs in (("pydoc_mc", multiple_choice(paras, questions, rng)), ("pydoc_gen", generation(paras, generations))):
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        template = MC_TASK if name == "pydoc_mc" else GEN_TASK
        (out / f"{name}.yaml").write_text(template.format(data=data.resolve(), max_gen_toks=max_gen_toks))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for the task files (pass it to lm_eval --include_path)")
    p.add_argument("--questions", type=int, default=200, help="multiple-choice questions (default 200)")
    p.add_argument("--generations", type=int, default=50, help="generation prompts (default 50)")
    p.add_argument("--max-gen-toks", type=int, default=16, help="tokens per generation at most (default 16)")
    args = p.parse_args(argv)
    print(write_tasks(args.out, args.questions, args.generations, args.max_gen_toks))


if __name__ == "__main__":
    main()
