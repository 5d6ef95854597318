# A verl-rs reward worker: loads a verl reward function from a Python file and scores rows sent
# by the trainer, in the frames of frames.py (prepended to this script).
#
#   argv: <file> <function> <mode: 0 (per row) | 1 (batched) | prime:<seconds per row>>
#   ready:    {"ready": true} or {"ready": false, "error": "..."}
#   request:  {"rows": [{"data_source", "solution_str", "ground_truth", "extra_info"}, ...]}
#   response: {"scores": [{"score": float, "extra": {name: float}, "pred"?: str}, ...]}
#             or {"error": "...", "row": index within the request}
#
# The function has verl's signature: compute_score(data_source, solution_str, ground_truth,
# extra_info) returning a number or a dict with "score" (its numeric entries, score too, are
# kept as extras, a "pred" as the answer validation's majority vote counts); batched
# (reward_manager=batch): compute_score(data_sources, solution_strs, ground_truths,
# extra_infos) returning one of those per row. Whatever the function prints
# goes to stderr, so it cannot break the frames.
#
# prime (verl's prime reward manager): each row has a time limit (an interval timer; the
# function runs on the main thread); a row that raises or runs out of time scores 0.0 and its
# score carries "failed": why; a tuple or list result counts its first element.
import importlib.util
import os
import signal
import sys
import traceback


class RowTimeout(BaseException):
    # Not an Exception: a function's own `except Exception` must not swallow its time limit.
    pass


def on_alarm(signum, frame):
    raise RowTimeout()


def prime_score(fn, r, limit):
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        value = fn(r["data_source"], r["solution_str"], r["ground_truth"], r["extra_info"])
        signal.setitimer(signal.ITIMER_REAL, 0)
        if isinstance(value, (tuple, list)):
            value = value[0]
        return as_score(value)
    except RowTimeout:
        return {"score": 0.0, "extra": {}, "failed": f"no score within {limit:g} s"}
    except Exception as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return {"score": 0.0, "extra": {}, "failed": f"{type(e).__name__}: {e}"}

def as_score(value):
    if isinstance(value, dict):
        # Every numeric entry, `score` too, as verl's managers keep them all as extras.
        extra = {k: float(v) for k, v in value.items() if isinstance(v, (int, float, bool))}
        out = {"score": float(value["score"]), "extra": extra}
        # The answer, for validation's majority vote (maj@N), as verl keeps it: any value.
        pred = value.get("pred")
        if isinstance(pred, float) and pred.is_integer():
            pred = int(pred)  # 7 and 7.0 are one answer to verl's vote (they compare equal)
        if pred is not None:
            out["pred"] = str(pred)
        return out
    return {"score": float(value), "extra": {}}


def main():
    path, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    batched = mode == "1"
    prime = float(mode.split(":", 1)[1]) if mode.startswith("prime:") else None
    try:
        spec = importlib.util.spec_from_file_location("verl_rs_custom_reward", path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        spec.loader.exec_module(module)
        fn = getattr(module, name)
    except Exception:
        send({"ready": False, "error": traceback.format_exc(limit=4)})
        return
    send({"ready": True})
    while True:
        request = receive()
        if request is None:
            return
        rows = request["rows"]
        if batched:
            try:
                values = fn(
                    data_sources=[r["data_source"] for r in rows],
                    solution_strs=[r["solution_str"] for r in rows],
                    ground_truths=[r["ground_truth"] for r in rows],
                    extra_infos=[r["extra_info"] for r in rows],
                )
                send({"scores": [as_score(v) for v in values]})
            except Exception:
                send({"error": traceback.format_exc(limit=4), "row": 0})
            continue
        if prime is not None:
            send({"scores": [prime_score(fn, r, prime) for r in rows]})
            continue
        scores = []
        for i, r in enumerate(rows):
            try:
                scores.append(as_score(fn(r["data_source"], r["solution_str"], r["ground_truth"], r["extra_info"])))
            except Exception:
                send({"error": traceback.format_exc(limit=4), "row": i})
                break
        else:
            send({"scores": scores})


main()
