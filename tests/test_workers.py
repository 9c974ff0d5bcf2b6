"""The worker pool, the environments and tools that run in it, and rewards scored there: each
failure ends as specified (a value, counted) and the pool goes on."""

from __future__ import annotations

import http.server
import json
import os
import textwrap
import threading
import time

import pytest

from shardflow.config.experiment import DataConfig, RewardConfig, RewardTermConfig
from shardflow.data.prompts import load_prompts
from shardflow.models.tiny import char_tokenizer
from shardflow.rl.envs import EnvSpec, check_env, checked_step
from shardflow.rl.envs.calculator import calculator
from shardflow.rl.envs.chat import ObservationFormat
from shardflow.rl.envs.python_sandbox import python
from shardflow.rl.envs.tools import ToolEnv, parse_hermes, tool_schema
from shardflow.rl.rewards import reward_function, reward_terms
from shardflow.rl.rewards.pooled import WARM_UP_CHANNEL, PooledRewards, warm_up
from shardflow.rl.workers import WorkerPool

TOOLS = textwrap.dedent('''
    import sys, time

    def slow(seconds: float) -> str:
        """Sleep, then answer."""
        time.sleep(seconds)
        return "woke"

    def broken(x: str) -> str:
        raise RuntimeError("the tool broke")

    def loud(n: int) -> str:
        """Print a lot."""
        for _ in range(n):
            print("x" * 1000)
            sys.stderr.write("")
        return "printed"

    class Counter:
        def __init__(self, row):
            self.turns, self.target = 0, int(row["turns"])

        def step(self, text):
            self.turns += 1
            if self.turns >= self.target:
                return None, 1.0, True
            return f"turn {self.turns}", 0.5, False

    class Sleepy:
        def __init__(self, row):
            pass

        async def step(self, text):
            import asyncio
            await asyncio.sleep(0.01)
            return None, 2.0, True

    def wrong_shape(*args):
        return "not a tuple"

    class Unreadable:  # pickles in the worker, fails to unpickle in the caller
        def __reduce__(self):
            return (int, ("not a number",))

    def unreadable():
        return Unreadable()
''')


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_tools.py").write_text(TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return "user_tools"


def collect(pool: WorkerPool, channel: str, n: int) -> dict:
    out = {}
    while len(out) < n:
        for r in pool.results(channel, wait=True, timeout=30):
            out[r.key] = r
    return out


def test_a_task_that_hangs_raises_dies_or_prints_ends_and_the_pool_goes_on(user_module):
    with WorkerPool(2) as pool:
        start = time.monotonic()
        pool.call("t", "slow", f"{user_module}:slow", 60, timeout_s=1.0)
        pool.call("t", "broken", f"{user_module}:broken", "x", timeout_s=5.0)
        pool.call("t", "loud", f"{user_module}:loud", 5000, timeout_s=10.0)  # 5 MB on its standard output
        pool.call("t", "dies", "os:_exit", 3, timeout_s=5.0)
        pool.call("t", "after", f"{user_module}:slow", 0, timeout_s=5.0)
        got = collect(pool, "t", 5)
        assert time.monotonic() - start < 20
    assert not got["slow"].ok and got["slow"].value.startswith("TimeoutError: took longer than 1 s")
    assert not got["broken"].ok and got["broken"].value == "RuntimeError: the tool broke"
    assert got["loud"].ok and got["loud"].value == "printed"
    assert not got["dies"].ok and "exited (code 3)" in got["dies"].value
    assert got["after"].ok and got["after"].value == "woke"
    assert pool.restarts == 2  # the hung worker and the dead one


def test_an_answer_that_cannot_be_read_fails_its_task_and_the_pool_goes_on(user_module):
    with WorkerPool(1) as pool:
        pool.call("t", "bad", f"{user_module}:unreadable", timeout_s=5.0)
        pool.call("t", "after", f"{user_module}:slow", 0, timeout_s=5.0)
        got = collect(pool, "t", 2)
    assert not got["bad"].ok and "ValueError" in got["bad"].value
    assert got["after"].ok and got["after"].value == "woke"


def test_episodes_live_in_their_worker_and_a_restart_loses_them(user_module):
    spec = EnvSpec(f"{user_module}:Counter")
    with WorkerPool(2) as pool:
        home, _ = pool.home_for()
        pool.call("e", "open", "shardflow.rl.envs.hosting:open_episode", "k", spec, {"turns": 2}, timeout_s=5,
                  home=home)
        pool.call("e", "s1", "shardflow.rl.envs.hosting:step_episode", "k", "hi", timeout_s=5, home=home)
        pool.call("e", "s2", "shardflow.rl.envs.hosting:step_episode", "k", "hi", timeout_s=5, home=home)
        got = collect(pool, "e", 3)
        assert got["s1"].value.observation == "turn 1" and got["s1"].value.reward == 0.5 and not got["s1"].value.done
        assert got["s2"].value.done and got["s2"].value.reward == 1.0
        pool.call("e", "hang", f"{user_module}:slow", 60, timeout_s=0.5, home=home)  # its worker restarts
        pool.call("e", "s3", "shardflow.rl.envs.hosting:step_episode", "k", "hi", timeout_s=5, home=home)
        got = collect(pool, "e", 2)
        assert not got["s3"].ok and "not open in this worker" in got["s3"].value


def test_async_environment_steps_and_bad_results_are_named(user_module):
    with WorkerPool(1) as pool:
        pool.call("e", "open", "shardflow.rl.envs.hosting:open_episode", "a", EnvSpec(f"{user_module}:Sleepy"), {},
                  timeout_s=5)
        pool.call("e", "step", "shardflow.rl.envs.hosting:step_episode", "a", "x", timeout_s=5)
        got = collect(pool, "e", 2)
    assert got["step"].value.reward == 2.0 and got["step"].value.done
    with pytest.raises(ValueError, match=r"step must return \(observation, reward, done\[, info\]\)"):
        checked_step("not a tuple", "env")
    with pytest.raises(ValueError, match="the reward must be a number"):
        checked_step(("obs", "high", False), "env")
    with pytest.raises(ValueError, match="an observation must be text, chat messages or None"):
        checked_step((3, 0.0, False), "env")


def test_environment_specs_are_checked_before_the_run(user_module):
    check_env(EnvSpec(f"{user_module}:Counter"))
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        check_env(EnvSpec(f"{user_module}:Nope"))
    with pytest.raises(ValueError, match="is a function, not a class"):
        check_env(EnvSpec(f"{user_module}:slow"))
    with pytest.raises(ValueError, match="needs rollout.tools"):
        check_env(EnvSpec("tools"))
    with pytest.raises(ValueError, match="neither a built-in tool"):
        check_env(EnvSpec("tools", ("abacus",)))


def test_tool_environment_runs_calls_and_reports_errors(user_module):
    env = ToolEnv({}, tools=["calculator", f"{user_module}:broken", f"{user_module}:loud"])
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "(3+4)*2"}}</tool_call>'
            '<tool_call>{"name": "broken", "arguments": {"x": "y"}}</tool_call>'
            '<tool_call>{"name": "abacus", "arguments": {}}</tool_call><tool_call>{not json}</tool_call>')
    observation, reward, done, info = env.step(text)
    assert [m["content"] for m in observation] == [
        "14", "error: RuntimeError: the tool broke", "error: no tool named 'abacus' (tools: calculator, broken, loud)",
        "error: the tool call is not valid JSON: Expecting property name enclosed in double quotes"]
    assert all(m["role"] == "tool" for m in observation) and reward == 0.0 and not done
    assert info == {"tool_calls": 4, "tool_errors": 3}
    assert env.step("the answer is 14") == (None, 0.0, True, {"tool_calls": 0, "tool_errors": 0})
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[0].arguments == {"a": 1}


def test_tool_schemas_for_the_chat_template():
    schema = tool_schema(calculator)["function"]
    assert schema["name"] == "calculator" and schema["description"].startswith("Evaluate an arithmetic")
    assert schema["parameters"] == {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": 'the expression, e.g. "(3 + 4) * 2"'}}}
    # the sandbox's own limits are keyword-only: not the model's to set
    assert list(tool_schema(python)["function"]["parameters"]["properties"]) == ["code"]


def test_calculator_by_hand():
    assert [calculator(e) for e in ("2+3*4", "7/2", "-(2**10)", "17//5", "17 % 5")] == ["14", "3.5", "-1024", "3",
                                                                                          "2"]
    for bad, message in [("__import__('os')", "only numbers"), ("2**1000", "exponents above"), ("1/0", "division"),
                         ("3 +", "not an arithmetic expression"), ("10**99*10**99", "too large")]:
        with pytest.raises((ValueError, ZeroDivisionError), match=message):
            calculator(bad)


def test_python_tool_limits_time_output_memory_and_network():
    assert python("print(sum(range(10)))") == "45\n"
    assert python("while True: pass", timeout_s=1).endswith("[killed: the program ran longer than 1 s]")
    out = python("while True: print('y' * 1000)", max_output_bytes=4000)
    assert out.endswith("[output cut at 4000 bytes]") and len(out) < 4100
    assert "MemoryError" in python("x = bytearray(1 << 31)", memory_mb=256)
    net = python("import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=3)", timeout_s=8)
    assert "OSError" in net or "network access is disabled" in net, net
    assert "ZeroDivisionError" in python("1/0") and python("1/0").endswith("[exit code 1]")


class _RewardServer(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - the http.server name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["responses"] == ["fail"]:
            self.send_response(500)
            self.end_headers()
            return
        reply = json.dumps({"rewards": [float(len(r)) for r in body["responses"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture()
def reward_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RewardServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()


def test_weighted_rewards_with_an_http_term_scored_in_the_pool(user_module, reward_server):
    config = RewardConfig(kind="weighted", terms={
        "correct": RewardTermConfig(kind="math", weight=1.0),
        "length": RewardTermConfig(kind="http", url=reward_server, weight=0.1)}, timeout_s=10)
    # by hand: "7" is right (1.0) and 1 character long (0.1); "8" is wrong, also 1 character
    assert reward_function(config)(["3+4="] * 2, ["7", "8"], ["7", "7"]) == pytest.approx([1.1, 0.1])
    with WorkerPool(2) as pool:
        scorer = PooledRewards(pool, config)
        for key, response in enumerate(["7", "8", "fail"]):
            scorer.submit(key, "3+4=", response, "7")
        scores = scorer.collect()
    assert scores.rewards[0] == pytest.approx(1.1) and scores.rewards[1] == pytest.approx(0.1)
    assert scores.rewards[2] == config.error_value and scores.errors == 1
    assert "answered 500" in scores.first_error
    assert {name: sorted(values) for name, values in scores.terms.items()} == {"correct": [0.0, 1.0],
                                                                             "length": [1.0, 1.0]}


def test_warm_up_builds_the_reward_in_every_worker_before_the_first_response(tmp_path, monkeypatch):
    """Each worker imports the user's reward module once, at the warm-up; scoring imports nothing more."""
    marks = tmp_path / "imported"
    (tmp_path / "user_reward.py").write_text(textwrap.dedent(f'''
        import os
        with open({str(marks)!r}, "a") as f:
            f.write(str(os.getpid()) + "\\n")

        def length(prompts, responses, answers):
            return [float(len(r)) for r in responses]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    config = RewardConfig(kind="function", function="user_reward:length")
    with WorkerPool(2) as pool:
        warm_up(pool, config)
        assert all(r.ok for r in collect(pool, WARM_UP_CHANNEL, 2).values())
        pids = marks.read_text().split()
        assert len(set(pids)) == 2  # one import in each worker
        scorer = PooledRewards(pool, config)
        for key, response in enumerate(["a", "bb", "ccc", "dddd"]):
            scorer.submit(key, "p", response, None)
        assert scorer.collect().rewards == {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    workers = [pid for pid in marks.read_text().split() if pid != str(os.getpid())]  # the scorer's own weights
    assert sorted(workers) == sorted(pids)


def test_warm_up_loads_what_the_math_reward_reads_with(tmp_path, monkeypatch):
    """The math reward's parser (about a second to import) comes in at the warm-up, not at the
    first response that needs it; a term of a weighted reward as well."""
    (tmp_path / "probe.py").write_text("import sys\n\n\ndef loaded(name):\n    return name in sys.modules\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    config = RewardConfig(kind="weighted", terms={"correct": RewardTermConfig(kind="math")})
    with WorkerPool(1) as pool:
        pool.call("probe", "before", "probe:loaded", "math_verify", timeout_s=30)
        assert collect(pool, "probe", 1)["before"].value is False
        warm_up(pool, config)
        assert all(r.ok for r in collect(pool, WARM_UP_CHANNEL, 1).values())
        pool.call("probe", "after", "probe:loaded", "math_verify", timeout_s=30)
        assert collect(pool, "probe", 1)["after"].value is True


def test_reward_terms_are_checked():
    with pytest.raises(ValueError, match="reward.kind=weighted needs reward.terms"):
        reward_terms(RewardConfig(kind="weighted"))
    with pytest.raises(ValueError, match="reward.url must be an http"):
        reward_terms(RewardConfig(kind="http", url="ftp://x"))
    assert reward_terms(RewardConfig(kind="none")) == {}


QWEN_LIKE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n"
             "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_observations_follow_the_chat_template_after_the_model_turn():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = QWEN_LIKE
    fmt = ObservationFormat(tokenizer, "tool", chat=True)
    # the turn ended with the template's own end-of-turn text: it is not repeated
    assert fmt.text("7", "<|im_end|>") == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    # a turn cut by its length gets it from here; chat messages keep their roles
    assert fmt.text([{"role": "user", "content": "go on"}], None) == \
        "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert ObservationFormat(tokenizer, "tool", chat=False).text("raw", None) == "raw"


def test_prompts_render_the_tool_list(tmp_path):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = QWEN_LIKE
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "3+4=", "answer": "7", "extra": 1}) + "\n")
    [prompt] = load_prompts(DataConfig(path=str(data)), tokenizer, tools=[tool_schema(calculator)], keep_rows=True)
    assert prompt.text.startswith("<|im_start|>system\ncalculator <|im_end|>\n<|im_start|>user\n3+4=")
    assert prompt.row == {"prompt": "3+4=", "answer": "7", "extra": 1}
