"""Locust users for dasc-serve (OpenAI API): `make loadtest` runs them headless against a running server.

Five workloads, each a user class (pick with `locust ... FewShotUser` or run all):
- FewShotUser: completions whose prompts share one of a few long few-shot headers, then a new question.
- ChatUser: multi-turn chat whose history grows turn by turn (each turn re-sends the whole history).
- ReuseDistanceUser: the paper's six-phase reuse-distance replay (C.2): phases whose working sets shrink
  (80, 36, 16, 8, 4 and 1 distinct prefixes), each walked in a seeded shuffled order, one output token.
- AgentUser: an agent loop over Chat Completions (loadtest/workloads.py, agentic): one shared system prompt with
  six tool schemas; each turn a call (`tool_choice` required or auto), the tool's result and an answer, the
  whole history re-sent every time.
- ResponsesAgentUser: the same loop over the Responses API, each turn only its new items with
  `previous_response_id`.
Every user is bounded by locust's --run-time; prompts are deterministic text (no tokenizer needed).
"""

from __future__ import annotations

import os
import random

from locust import HttpUser, between, task

from loadtest.workloads import AGENT_TOOLS, agent_system

# The served model name to send (`api.served_model_name`); unset: requests name none and get the served model.
NAMED = {"model": os.environ["DASC_MODEL"]} if os.environ.get("DASC_MODEL") else {}
HEADERS = {"Authorization": f"Bearer {os.environ.get('DASC_API_KEY', 'none')}"}
PHASES = (80, 36, 16, 8, 4, 1)


def text_block(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    names = ("total", "count", "items", "value", "path", "config", "result", "index")
    return "\n".join(f"{rng.choice(names)}_{seed}_{i} = {rng.randint(0, 9999)}" for i in range(lines))


FEW_SHOT_HEADERS = [text_block(1000 + h, 60) + "\n# Q: what is the next value?\n" for h in range(4)]


class _ApiUser(HttpUser):
    abstract = True
    wait_time = between(0.05, 0.3)

    def complete(self, prompt: str, max_tokens: int, name: str) -> None:
        with self.client.post("/v1/completions", json={**NAMED, "prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0}, headers=HEADERS, name=name,
                              catch_response=True) as r:
            if r.status_code != 200 or "choices" not in r.json():
                r.failure(f"{r.status_code}: {r.text[:200]}")


class FewShotUser(_ApiUser):
    @task
    def ask(self) -> None:
        header = random.choice(FEW_SHOT_HEADERS)
        self.complete(header + text_block(random.randrange(10**6), 3), 8, "few-shot")


class ChatUser(_ApiUser):
    max_turns = 6

    def on_start(self) -> None:
        self.history: list[dict] = []

    @task
    def turn(self) -> None:
        if len(self.history) >= 2 * self.max_turns:
            self.history = []
        self.history.append({"role": "user", "content": text_block(random.randrange(10**6), 4)})
        with self.client.post("/v1/chat/completions", json={**NAMED, "messages": self.history,
                                                            "max_tokens": 12, "temperature": 0},
                              headers=HEADERS, name="chat", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                return
            self.history.append(r.json()["choices"][0]["message"])


class ReuseDistanceUser(_ApiUser):
    def on_start(self) -> None:
        self.rng = random.Random(42)
        self.phase, self.queue = 0, []

    @task
    def replay(self) -> None:
        if not self.queue:
            size = PHASES[self.phase % len(PHASES)]
            self.queue = [text_block(5000 + 100 * self.phase + i, 40) for i in range(size)] * 2
            self.rng.shuffle(self.queue)
            self.phase += 1
        self.complete(self.queue.pop(), 1, f"reuse-phase-{PHASES[(self.phase - 1) % len(PHASES)]}")


AGENT_SYSTEM = agent_system(7)


class AgentUser(_ApiUser):
    max_turns = 5

    def on_start(self) -> None:
        self.rng = random.Random()
        self.reset()

    def reset(self) -> None:
        self.turns = 0
        self.messages = [{"role": "system", "content": AGENT_SYSTEM},
                         {"role": "user", "content": f"Find why value_{self.rng.randint(0, 999)} is wrong."}]

    def ask(self, tool_choice: str, max_tokens: int, name: str) -> dict | None:
        body = {**NAMED, "messages": self.messages, "tools": AGENT_TOOLS, "tool_choice": tool_choice,
                "parallel_tool_calls": False, "max_tokens": max_tokens, "temperature": 0}
        with self.client.post("/v1/chat/completions", json=body, headers=HEADERS, name=name,
                              catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                return None
            return r.json()["choices"][0]["message"]

    @task
    def turn(self) -> None:
        if self.turns >= self.max_turns:
            self.reset()
        self.turns += 1
        message = self.ask("required" if self.rng.random() < 0.5 else "auto", 96, "agent-call")
        if message is None:
            return self.reset()
        if message.get("tool_calls"):
            self.messages.append(message)
            self.messages += [{"role": "tool", "tool_call_id": c["id"], "content": text_block(
                self.rng.randrange(10**6), self.rng.randint(8, 15))} for c in message["tool_calls"]]
            message = self.ask("auto", 12, "agent-answer")
            if message is None:
                return self.reset()
        self.messages.append({"role": "assistant", "content": message.get("content") or ""})
        self.messages.append({"role": "user", "content": f"And value_{self.rng.randint(0, 999)}?"})


RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in AGENT_TOOLS]


class ResponsesAgentUser(_ApiUser):
    """AgentUser's loop over the Responses API: each request after the first sends only its new items with
    `previous_response_id` (the server resumes from the stored ids)."""

    max_turns = 5

    def on_start(self) -> None:
        self.rng = random.Random()
        self.reset()

    def reset(self) -> None:
        self.turns, self.previous = 0, None
        self.items = [{"role": "system", "content": AGENT_SYSTEM},
                      {"role": "user", "content": f"Find why value_{self.rng.randint(0, 999)} is wrong."}]

    def ask(self, tool_choice: str, max_tokens: int, name: str) -> list[dict] | None:
        body = {**NAMED, "input": self.items, "previous_response_id": self.previous, "tools": RESPONSE_TOOLS,
                "tool_choice": tool_choice, "parallel_tool_calls": False, "max_output_tokens": max_tokens,
                "temperature": 0}
        with self.client.post("/v1/responses", json=body, headers=HEADERS, name=name, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                return None
            answer = r.json()
        self.previous = answer["id"]
        return [o for o in answer["output"] if o["type"] == "function_call"]

    @task
    def turn(self) -> None:
        if self.turns >= self.max_turns:
            self.reset()
        self.turns += 1
        calls = self.ask("required" if self.rng.random() < 0.5 else "auto", 96, "responses-call")
        if calls is None:
            return self.reset()
        if calls:
            self.items = [{"type": "function_call_output", "call_id": c["call_id"], "output": text_block(
                self.rng.randrange(10**6), self.rng.randint(8, 15))} for c in calls]
            if self.ask("auto", 12, "responses-answer") is None:
                return self.reset()
        self.items = [{"role": "user", "content": f"And value_{self.rng.randint(0, 999)}?"}]
