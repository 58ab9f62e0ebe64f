"""Workloads built on fork/join: tree-of-thought (nested forks), skeleton-of-thought (a skeleton,
then one branch per point) and an LLM judge (one branch per dimension, then a merge).

At every fork the branches share everything the state holds so far; each branch then appends its
own text and generates."""

from __future__ import annotations

import random
from typing import Any

import radixlm as sgl

from .common import paragraph, program_workload, sentence

VERDICTS = ["sure", "likely", "impossible"]
DIMENSIONS = ["accuracy", "relevance", "clarity", "depth", "originality", "safety"]


@sgl.function
def tree_of_thought(s, instruction, question, breadth, thought_tokens):
    s += instruction + "Question: " + question + "\n"
    plans = s.fork(breadth)
    for i, plan in enumerate(plans):
        plan += f"Approach {i + 1}:" + sgl.gen("plan", max_tokens=thought_tokens)
    for plan in plans:
        steps = plan.fork(breadth)
        for j, step in enumerate(steps):
            step += f"\nNext step {j + 1}:" + sgl.gen("step", max_tokens=thought_tokens)
            step += "\nCan this step reach the answer (sure/likely/impossible)?"
            step += sgl.select("verdict", choices=VERDICTS)
        steps.join()
    plans.join()


def tree_of_thought_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    instruction = ("Solve the problem step by step. Propose several approaches, expand each, and judge "
                   "whether each step can reach the answer.\n" + paragraph(rng, size["instruction_sentences"])
                   + "\n")
    return [{"instruction": instruction, "question": paragraph(rng, size["question_sentences"]),
             "breadth": size["breadth"], "thought_tokens": size["thought_tokens"]} for _ in range(n)]


TREE_OF_THOUGHT = program_workload(
    "tree_of_thought", "Tree-of-thought: two levels of nested forks, select at the leaves", tree_of_thought,
    sizes={"tiny": {"instruction_sentences": 2, "question_sentences": 1, "breadth": 2, "thought_tokens": 4},
           "gpu": {"instruction_sentences": 4, "question_sentences": 2, "breadth": 3, "thought_tokens": 24}},
    instances={"tiny": 3, "gpu": 32}, hf_instances={"gpu": 4}, make_args=tree_of_thought_args)


@sgl.function
def skeleton_of_thought(s, instruction, question, points, skeleton_tokens, point_tokens):
    s += instruction + "Question: " + question + "\nSkeleton:"
    s += sgl.gen("skeleton", max_tokens=skeleton_tokens)
    expansions = s.fork(points)
    for i, expansion in enumerate(expansions):
        expansion += f"\nContinue and write only point {i + 1}, in detail:"
        expansion += sgl.gen("point", max_tokens=point_tokens)
    expansions.join()


def skeleton_of_thought_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    instruction = ("You are an organizer. Give only the skeleton of the answer (a numbered list of short "
                   "points), then expand each point on its own.\n" + paragraph(rng, size["instruction_sentences"])
                   + "\n")
    return [{"instruction": instruction, "question": sentence(rng, 10, 20), "points": size["points"],
             "skeleton_tokens": size["skeleton_tokens"], "point_tokens": size["point_tokens"]} for _ in range(n)]


SKELETON_OF_THOUGHT = program_workload(
    "skeleton_of_thought", "Skeleton-of-thought: a skeleton, then one fork per point, joined",
    skeleton_of_thought,
    sizes={"tiny": {"instruction_sentences": 2, "points": 3, "skeleton_tokens": 6, "point_tokens": 5},
           "gpu": {"instruction_sentences": 10, "points": 5, "skeleton_tokens": 32, "point_tokens": 48}},
    instances={"tiny": 4, "gpu": 52}, hf_instances={"gpu": 12}, make_args=skeleton_of_thought_args)


@sgl.function
def llm_judge(s, instruction, question, answer, dimensions, explanation_tokens):
    s += instruction + "Question: " + question + "\nAnswer: " + answer + "\n"
    judges = s.fork(len(dimensions))
    for judge, dimension in zip(judges, dimensions):
        judge += f"Evaluate the answer on {dimension}. Explanation:"
        judge += sgl.gen("explanation", max_tokens=explanation_tokens)
        judge += "\nScore (1 to 10):" + sgl.gen("score", max_tokens=2)
    judges.join()
    s += "\nOverall verdict:" + sgl.gen("verdict", max_tokens=explanation_tokens)


def llm_judge_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    instruction = ("Please act as an impartial judge and evaluate the quality of the answer to the question "
                   "below, one dimension at a time.\n" + paragraph(rng, size["instruction_sentences"]) + "\n")
    return [{"instruction": instruction, "question": sentence(rng, 10, 20),
             "answer": paragraph(rng, size["answer_sentences"]), "dimensions": DIMENSIONS[: size["dimensions"]],
             "explanation_tokens": size["explanation_tokens"]} for _ in range(n)]


LLM_JUDGE = program_workload(
    "llm_judge", "LLM judge: a fork per dimension over a shared question and answer, then a merge",
    llm_judge,
    sizes={"tiny": {"instruction_sentences": 2, "answer_sentences": 3, "dimensions": 3, "explanation_tokens": 4},
           "gpu": {"instruction_sentences": 8, "answer_sentences": 8, "dimensions": 6, "explanation_tokens": 24}},
    instances={"tiny": 4, "gpu": 44}, hf_instances={"gpu": 10}, make_args=llm_judge_args)
