"""Agent workloads: a ReAct agent and generative agents.

ReAct: a long instruction (tool descriptions and two worked examples) shared by every task, then a
history that grows step by step: each step generates a thought and an action, and appends the tool's
observation; every call's prompt is the previous call's prompt plus its output and new text.

Generative agents: each call is built from templates: a world description shared by every agent, an
agent's own profile shared by all its ticks, then a templated observation and three templated
questions (importance on a scale, a reaction, a line of dialogue) with short answers."""

from __future__ import annotations

import random
from typing import Any

import radixlm as sgl

from .common import paragraph, program_workload, sentence, words


@sgl.function
def react(s, instruction, question, observations, thought_tokens, action_tokens):
    s += instruction + "Question: " + question + "\n"
    for i, observation in enumerate(observations, 1):
        s += f"Thought {i}:" + sgl.gen(f"thought_{i}", max_tokens=thought_tokens)
        s += f"\nAction {i}:" + sgl.gen(f"action_{i}", max_tokens=action_tokens)
        s += f"\nObservation {i}: {observation}\n"


def react_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    tools = "".join(f"({i}) {words(rng, 1).title()}[{words(rng, 1)}], which {sentence(rng, 10, 20)}\n"
                    for i in range(1, 4))
    demos = ""
    for _ in range(size["demos"]):
        demos += "Question: " + sentence(rng, 8, 16) + "\n"
        for i in range(1, size["steps"] + 1):
            demos += (f"Thought {i}: {sentence(rng, 10, 20)}\nAction {i}: Search[{words(rng, 2)}]\n"
                      f"Observation {i}: {paragraph(rng, size['observation_sentences'])}\n")
        demos += "\n"
    instruction = ("Solve a question answering task with interleaving Thought, Action, Observation steps. "
                   "Thought can reason about the current situation, and Action can be three types:\n"
                   + tools + "Here are some examples.\n" + demos)
    return [{"instruction": instruction, "question": sentence(rng, 8, 16),
             "observations": [paragraph(rng, size["observation_sentences"]) for _ in range(size["steps"])],
             "thought_tokens": size["thought_tokens"], "action_tokens": size["action_tokens"]}
            for _ in range(n)]


REACT = program_workload(
    "react", "ReAct agent: long shared instruction, multi-step history growing by outputs and observations",
    react,
    sizes={"tiny": {"demos": 1, "steps": 2, "observation_sentences": 1, "thought_tokens": 4, "action_tokens": 3},
           "gpu": {"demos": 2, "steps": 3, "observation_sentences": 2, "thought_tokens": 24, "action_tokens": 8}},
    instances={"tiny": 4, "gpu": 128}, hf_instances={"gpu": 8}, make_args=react_args)


@sgl.function
def generative_agent(s, world, profile, name, observation, short_tokens, reply_tokens):
    s += world + profile
    s += f"\nIt is now {observation['time']}. {name} observes: {observation['event']}\n"
    s += (f"On a scale of 1 to 9, where 1 is mundane and 9 is extremely poignant, rate the importance of "
          f"this observation for {name}. Rating:" + sgl.gen("importance", max_tokens=short_tokens))
    s += f"\nShould {name} react to the observation, and if so, what would be an appropriate reaction? Reaction:"
    s += sgl.gen("reaction", max_tokens=reply_tokens)
    s += f"\nWhat would {name} say? {name}:" + sgl.gen("utterance", max_tokens=reply_tokens)


def generative_agents_args(n: int, size: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    world = "You are simulating a small town.\n" + paragraph(rng, size["world_sentences"]) + "\n"
    agents = []
    for _ in range(size["agents"]):
        name = words(rng, 1).title() + " " + words(rng, 1).title()
        profile = (f"Name: {name}\nInnate traits: {words(rng, 3)}\n"
                   f"Summary of {name}'s memories: " + paragraph(rng, size["profile_sentences"]) + "\n")
        agents.append((name, profile))
    out = []
    for i in range(n):
        name, profile = agents[i % len(agents)]
        observation = {"time": f"{8 + i % 12}:{(7 * i) % 60:02d}", "event": sentence(rng, 8, 16)}
        out.append({"world": world, "profile": profile, "name": name, "observation": observation,
                    "short_tokens": size["short_tokens"], "reply_tokens": size["reply_tokens"]})
    return out


GENERATIVE_AGENTS = program_workload(
    "generative_agents", "Generative agents: templated calls, world and per-agent profile shared, short outputs",
    generative_agent,
    sizes={"tiny": {"agents": 2, "world_sentences": 3, "profile_sentences": 2, "short_tokens": 2,
                    "reply_tokens": 4},
           "gpu": {"agents": 4, "world_sentences": 12, "profile_sentences": 10, "short_tokens": 2,
                   "reply_tokens": 16}},
    instances={"tiny": 6, "gpu": 128}, hf_instances={"gpu": 24},
    make_args=generative_agents_args)
