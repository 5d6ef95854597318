# A verl-rs tracking worker: hands each step's metrics to the experiment trackers that verl's
# `trainer.logger` names, set up as verl sets them up (project and experiment names, the
# resolved config, the same environment variables), in the frames of frames.py (prepended
# to this script).
#
#   argv: <backend>[,<backend>...] among wandb, mlflow, tensorboard, swanlab, trackio, clearml
#   init:     {"project": str, "experiment": str, "config": {...}}
#             -> {"ready": true} or {"ready": false, "error": "...", "backend": name}
#   log:      {"step": int, "data": {name: float}} -> {"ok": true} or {"error": "..."}
#   finish:   {"finish": true} -> {"ok": true}, then the worker exits
#
# Whatever the libraries print goes to stderr, so it cannot break the frames.
import os
import re
import sys
import traceback

def flatten(value, prefix=""):
    """A nested config as flat "a/b/c" keys (lists by index), as verl hands mlflow its params."""
    out = {}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    if items is None:
        out[prefix] = value
        return out
    for k, v in items:
        out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


class Wandb:
    def __init__(self, project, experiment, config):
        import wandb

        proxy = (config.get("trainer") or {}).get("wandb_proxy")
        settings = wandb.Settings(https_proxy=proxy) if proxy else None
        wandb.init(project=project, name=experiment, entity=os.environ.get("WANDB_ENTITY"),
                   config=config, settings=settings)
        self.wandb = wandb

    def log(self, step, data):
        self.wandb.log(data=data, step=step)

    def log_generations(self, step, samples):
        # verl's table: one row per validation, "step" then input_i / output_i / score_i,
        # rebuilt with the earlier rows each time (wandb tables do not grow once logged).
        columns = ["step"] + [f"{c}_{i + 1}" for i in range(len(samples))
                              for c in ("input", "output", "score")]
        row = [step] + [v for s in samples for v in s]
        self.rows = getattr(self, "rows", []) + [row]
        table = self.wandb.Table(columns=columns, data=self.rows)
        self.wandb.log({"val/generations": table}, step=step)

    def finish(self):
        self.wandb.finish(exit_code=0)


class Mlflow:
    # mlflow accepts letters, digits, underscores, periods, dashes, colons, spaces and single
    # slashes in metric names; verl writes "@" as "_at_" and the rest as "_".
    INVALID = re.compile(r"[^/\w.\- :]")
    SLASHES = re.compile(r"/+")

    def __init__(self, project, experiment, config):
        import mlflow

        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", "sqlite:////tmp/mlruns.db"))
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if run_id:
            mlflow.start_run(run_id=run_id)
        else:
            experiment_record = mlflow.set_experiment(project)
            mlflow.start_run(experiment_id=experiment_record.experiment_id, run_name=experiment)
        mlflow.log_params(flatten(config))
        self.mlflow = mlflow

    def key(self, name):
        return self.INVALID.sub("_", self.SLASHES.sub("/", name.replace("@", "_at_")))

    def log(self, step, data):
        self.mlflow.log_metrics(metrics={self.key(k): v for k, v in data.items()}, step=step)

    def log_generations(self, step, samples):
        # verl's artifact: val_step<step>.json, a list of {input, output, score}.
        import json
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"val_step{step}.json")
            with open(path, "w") as f:
                json.dump([{"input": i, "output": o, "score": s} for i, o, s in samples], f)
            self.mlflow.log_artifact(path)

    def finish(self):
        self.mlflow.end_run()


class Tensorboard:
    def __init__(self, project, experiment, config):
        from torch.utils.tensorboard import SummaryWriter

        directory = os.environ.get("TENSORBOARD_DIR", f"tensorboard_log/{project}/{experiment}")
        os.makedirs(directory, exist_ok=True)
        print(f"tensorboard log in {directory}")
        self.writer = SummaryWriter(directory)

    def log(self, step, data):
        for k, v in data.items():
            self.writer.add_scalar(k, v, step)

    def log_generations(self, step, samples):
        # verl's text: a markdown block per validation, sample by sample.
        text = f"**Generation Results - Step {step}**\n\n"
        for n, (i, o, s) in enumerate(samples):
            text += f"### Sample {n + 1}\n**Input:** {i}\n\n**Output:** {o}\n\n**Score:** {s}\n\n---\n\n"
        self.writer.add_text("val/generations", text, step)
        self.writer.flush()

    def finish(self):
        self.writer.close()


class Swanlab:
    def __init__(self, project, experiment, config):
        import swanlab

        key = os.environ.get("SWANLAB_API_KEY")
        if key:
            swanlab.login(key)
        swanlab.init(project=project, experiment_name=experiment,
                     config={"FRAMEWORK": "verl", **config},
                     logdir=os.environ.get("SWANLAB_LOG_DIR", "swanlog"),
                     mode=os.environ.get("SWANLAB_MODE", "cloud"))
        self.swanlab = swanlab

    def log(self, step, data):
        self.swanlab.log(data=data, step=step)

    def log_generations(self, step, samples):
        table = self.swanlab.echarts.Table()
        table.add(headers=["step", "input", "output", "score"],
                  rows=[[step, *s] for s in samples])
        self.swanlab.log({"val/generations": table}, step=step)

    def finish(self):
        self.swanlab.finish()


class Trackio:
    def __init__(self, project, experiment, config):
        import trackio

        trackio.init(project=project, name=experiment, config=config)
        self.trackio = trackio

    def log(self, step, data):
        self.trackio.log(data=data, step=step)

    def finish(self):
        self.trackio.finish()


class Clearml:
    # verl's ClearMLLogger: a task named after the experiment (continuing the last one, no
    # artifact upload), the config as its hyperparameters, each metric "title/series" a scalar.
    def __init__(self, project, experiment, config):
        import clearml

        self.task = clearml.Task.init(task_name=experiment, project_name=project,
                                      continue_last_task=True, output_uri=False)
        self.task.connect_configuration(config, name="Hyperparameters")

    def log(self, step, data):
        logger = self.task.get_logger()
        for k, v in data.items():
            title, series = k.split("/", 1) if "/" in k else (k, k)
            logger.report_scalar(title=title, series=series, value=v, iteration=step)

    def log_generations(self, step, samples):
        import pandas as pd

        table = [{"step": step, "input": i, "output": o, "score": s} for i, o, s in samples]
        self.task.get_logger().report_table(series="Validation generations", title="Validation",
                                            table_plot=pd.DataFrame.from_records(table),
                                            iteration=step)

    def finish(self):
        self.task.close()


BACKENDS = {"wandb": Wandb, "mlflow": Mlflow, "tensorboard": Tensorboard, "swanlab": Swanlab,
            "trackio": Trackio, "clearml": Clearml}


def main():
    names = [n for n in sys.argv[1].split(",") if n]
    init = receive()
    if init is None:
        return
    trackers = []
    for name in names:
        try:
            trackers.append(BACKENDS[name](init["project"], init["experiment"], init["config"]))
        except Exception:
            send({"ready": False, "backend": name, "error": traceback.format_exc(limit=3)})
            return
    send({"ready": True})
    while True:
        message = receive()
        if message is None or message.get("finish"):
            for t in trackers:
                try:
                    t.finish()
                except Exception:
                    traceback.print_exc(limit=3)
            if message is not None:
                send({"ok": True})
            return
        try:
            if "generations" in message:
                # Validation samples (trainer.log_val_generations): the trackers verl logs
                # them to; trackio has no such table in verl.
                for t in trackers:
                    if hasattr(t, "log_generations"):
                        t.log_generations(message["step"], message["generations"])
            else:
                for t in trackers:
                    t.log(message["step"], message["data"])
            send({"ok": True})
        except Exception:
            send({"error": traceback.format_exc(limit=3)})


main()
