"""Triton Python-backend model: the FlashMap target (TargetEngine), one KV slot per sequence.

Each Triton sequence (correlation id) owns one KV slot of the engine:
- a request with START allocates a slot for its correlation id (replacing any it had);
- every request with tokens becomes one VerifyRow; all requests that Triton hands to one
  execute() call are verified by ONE engine.verify (one forward pass);
- a request with END releases the slot after its verify (END with no tokens = release/cancel);
- slots of sequences idle longer than max_sequence_idle_microseconds are freed here, because
  Triton's sequence batcher drops idle sequences without telling the model
  (target_service.sequence_slots keeps who holds which slot);
- a request with INFO = true answers INFO_JSON (vocab size, feature layers, ...) instead.

Tensor contract (config.pbtxt; every tensor has a leading batch dimension of 1; encoded and
decoded by flashmap.target_wire on both sides):
  in:  TOKENS INT64 [L], START_POS INT64 [1], SUPPORT_IDS INT64 [K, S] (-1 padded, K may be 0),
       TEMPERATURE FP32 [1], TOP_K INT32 [1], TOP_P FP32 [1], ROUND_SEED INT64 [1], INFO BOOL [1],
       PARENTS INT64 [K] (T = 0: the drafts form a tree, draft i a child of draft PARENTS[i], -1 the anchor),
       NEXT_SEEDS INT64 [steps - 1] (K = 0: decode that many more tokens in this call),
       NO_FEATURES BOOL [1] (true: FEATURES [0, F]; a sequence that does not draft needs none),
       FEATURES_FROM INT64 [1] (FEATURES start at this earlier position: the engine keeps them),
       LOGPROBS INT32 [1] (n: the log-probabilities below, with the top n tokens; absent: none)
  out: ARGMAX INT64 [K+1], SUPPORT_PROBS FP32 [K, S], COMPLEMENT FP32 [K], RESIDUAL INT64 [K+1],
       FEATURES FP32|FP16 [L, F] (with FEATURES_FROM p: [START_POS - p + L, F]; with NEXT_SEEDS:
       ARGMAX and RESIDUAL [steps], FEATURES [L + steps - 1, F]), PATH INT64 [a] (a tree's
       accepted drafts; its other outputs are that path's), INFO_JSON BYTES [1],
       TOKEN_LOGPROBS FP32 [K+1, S+1] (raw log-probabilities of the support ids, then of the own
       token: ARGMAX at T = 0, RESIDUAL otherwise), TOP_IDS INT64 [K+1, n], TOP_LOGPROBS FP32
       [K+1, n] (all [0, 0] without LOGPROBS; rows of NEXT_SEEDS: [steps, ...])
Tree rows are verified in one forward (TargetEngine.verify_trees), the others in another.
A row whose TOKENS are [-1] (flashmap.types.FOLLOW_TOKEN, a continuation) is fed the last
token its sequence's previous verify decoded: that verify had no drafts and ended where this
row's START_POS is, else INVALID_ARGUMENT. Rows of one sequence in one execute() (a round and
its continuation, a verify and a release) run in the order they came, each its own forward.

Packed rounds: a request with ROWS BYTES [1] (flashmap.target_wire.packed_round) carries many rows,
each with its own sequence id and START / END flags and the tensors above; it is sent as a
one-request sequence (START and END on a throw-away correlation id) and answered with
ROWS_OUT BYTES [1], per row the outputs above or an error (code and message). Its rows are
admitted exactly as one-row requests are and share the execute's forward, so a round is one
request and one forward however many sequences it has.

Decoupled (config.pbtxt): execute() queues the batch and returns, so Triton hands over the next
batch (a round sent ahead) while this one computes. One worker thread runs the batches in the
order they came and answers each request on its response sender (one final response per
request). Clients use Triton's gRPC stream (ModelStreamInfer; flashmap.triton_stream): unary
infer and HTTP infer are refused for a decoupled model.

Errors: engine InvalidRequest -> that row alone gets TritonError(INVALID_ARG, message) (in a
packed round: its error entry); no free slot -> UNAVAILABLE; anything else -> INTERNAL for the
rows of that forward. A stream carries the message but not the code, so the message leads
with the code's name (flashmap.target_wire.tag_error: "[INVALID_ARGUMENT] ...").

Configuration: TargetModelConfig (target_service/target_config.py: checkpoint, max_seq_len,
device, dtype, feature layers, CUDA graphs, cpus, the drafter the features are for), from the
config's target_model_config parameter (JSON; the launcher writes it) and, for the settings it
leaves out, the environment. cpus: the worker thread runs on those CPUs alone (flashmap.cpus),
the server's other threads where the server was started.
n_slots = oldest.max_candidate_sequences; idle timeout = max_sequence_idle_microseconds.
The project must be importable by the stub's Python: target_service/launcher.py passes it on
PYTHONPATH; a stub that runs Python in isolated mode ignores PYTHONPATH, and then a .pth file in
that Python's site directory does it (deploy/Dockerfile.triton).

Metrics (Triton's /metrics): flashmap_target_active_sequences, flashmap_target_slots,
flashmap_target_batch_size (rows in the last forward), flashmap_target_verify_batches_total,
flashmap_target_verify_rows_total, flashmap_target_idle_released_total, and per batch handed
to execute() flashmap_target_batches_total, flashmap_target_batch_wait_seconds_total (behind the
batch before it), flashmap_target_batch_run_seconds_total (Triton's own compute time is only
the hand-over of a decoupled model's batch) and, of the run,
flashmap_target_batch_answer_seconds_total (the answers handed to Triton: each send waits for
the server to take it) and flashmap_target_batch_cpu_seconds_total (the worker thread's CPU time
in its runs: a run longer than its CPU time waited); sent with the model's log lines by the
worker, between batches, at most every 0.25 s, so that one thread makes all of the model's calls
into the stub (target_service.side_channel).

One idea: Triton's Python-backend interface to the engine (its requests, rows and answers).
"""

from __future__ import annotations

import faulthandler
import json
import os
import queue
import re
import sys
import threading
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

try:  # a clear message beats a bare ModuleNotFoundError in the server log
    import torch

    from flashmap import target_wire
    from flashmap.cpus import format_cpu_list, pin_worker
    from flashmap.drafter_inputs import target_inputs
    from flashmap.metrics import TARGET_MODEL
    from flashmap.types import InvalidRequest
    from target_service import engine as engine_module
    from target_service.sequence_slots import SequenceSlots
    from target_service.side_channel import SideChannel
    from target_service.target_config import TargetModelConfig
except ImportError as e:  # pragma: no cover - only in a misconfigured server
    raise ImportError(
        f"flashmap_target: cannot import the FlashMap project ({e}). Put the project root and an "
        "environment with torch/transformers on the stub Python's path (target_service/launcher.py; in "
        "an image, a .pth file as deploy/Dockerfile.triton writes)."
    ) from e


FINALIZE_DUMP_S = 8.0  # seconds of unloading before the model's threads' stacks go to the log
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = cfg = json.loads(args["model_config"])
        self.triton_model = args["model_name"]
        try:
            settings = TargetModelConfig.from_triton(cfg)
            model_dir = settings.checkpoint()
            device = settings.device_for(torch.cuda.is_available())
            dtype_name = settings.dtype_for(device)
            graphs = settings.graphs_for(device)
        except ValueError as e:
            raise ValueError(f"flashmap_target: {e}") from None
        dtype = DTYPES[dtype_name]
        self.cpus = settings.cpu_set
        feature_layers, projection = target_inputs(
            settings.drafter_dir,
            model_dir,
            settings.layers,
            project=settings.context_projection != "false",
        )

        seq = cfg["sequence_batching"]
        n_slots = int(seq["oldest"]["max_candidate_sequences"])
        # Triton drops a sequence after this idle time; we free its KV slot after the same time.
        self.idle_timeout_s = int(seq.get("max_sequence_idle_microseconds", 1_000_000_000)) / 1e6

        feat_cfg = pb_utils.get_output_config_by_name(cfg, "FEATURES")
        self.features_np_dtype = pb_utils.triton_string_to_numpy(feat_cfg["data_type"])

        self.engine = engine_module.TargetEngine(
            model_dir,
            n_slots=n_slots,
            max_seq_len=settings.max_seq_len,
            device=device,
            dtype=dtype,
            feature_layers=feature_layers,
            cuda_graphs=graphs,
            features_dtype=torch.float16 if self.features_np_dtype == np.float16 else torch.float32,
            context_projection=projection,
        )
        e = self.engine
        self.info = {
            "model_name": os.path.basename(os.path.normpath(str(model_dir))),
            "model_dir": str(model_dir),
            "triton_model": self.triton_model,
            "vocab_size": int(e.vocab_size),
            "hidden_size": int(e.hidden_size),
            "num_layers": int(e.num_layers),
            "feature_layers": [int(x) for x in e.feature_layers],
            "feature_dim": int(e.feature_dim),
            "context_projected": projection is not None,
            "features_dtype": np.dtype(self.features_np_dtype).name,
            "max_seq_len": int(e.max_seq_len),
            "n_slots": int(e.n_slots),
            "packed_verify": e.packed_verify,  # how the controller prices a verify (flashmap.speculation)
            "cuda_graphs": e.graphs is not None,
            "eos_token_ids": [int(x) for x in e.eos_token_ids],
            "kv_bytes_per_token": int(e.kv_bytes_per_token),
            "feature_bytes_per_token": int(
                e.feature_bytes_per_token
            ),  # kept features (VerifyRow.features_from)
            "idle_timeout_s": self.idle_timeout_s,
            "device": str(device),
            "dtype": dtype_name,
            "cpus": ""
            if self.cpus is None
            else format_cpu_list(
                self.cpus
            ),  # asked for the worker ("" = none); the log warns if it could not be
        }
        self.info_bytes = json.dumps(self.info).encode()

        # The reaper thread and the worker both touch the engine's slots: one lock for both.
        self.lock = threading.Lock()
        # Decoupled: execute() queues, the worker runs the batches in order and answers them.
        self._jobs = queue.SimpleQueue()
        self._init_metrics()
        self.seqs = SequenceSlots(self.engine, self.idle_timeout_s, self.metrics)
        self._stop = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap_loop, name="flashmap-idle-reaper", daemon=True
        )
        self._reaper.start()
        self._worker = threading.Thread(target=self._work_loop, name="flashmap-worker", daemon=True)
        self._worker.start()
        self._log("info", f"flashmap_target ready: {self.info}")

    # ------------------------------------------------------------------ metrics

    def _init_metrics(self):
        labels = {"model": self.info["model_name"]}
        kinds = {"gauge": pb_utils.MetricFamily.GAUGE, "counter": pb_utils.MetricFamily.COUNTER}
        # Keep the families alive as long as the model: its metrics die with them.
        self._families = [
            pb_utils.MetricFamily(name=m.name, description=m.help, kind=kinds[m.kind])
            for m in TARGET_MODEL
        ]
        self.metrics = SideChannel(
            {
                spec.name: fam.Metric(labels=labels)
                for spec, fam in zip(TARGET_MODEL, self._families)
            },
            pb_utils.Logger,
            wake=lambda: self._jobs.put(()),  # an empty job: the worker flushes when due
        )
        self._log = self.metrics.log
        self.metrics.set("flashmap_target_slots", self.engine.n_slots)
        self.metrics.set("flashmap_target_active_sequences", 0)

    def _update_active(self):
        self.metrics.set("flashmap_target_active_sequences", len(self.seqs))

    def _reap_loop(self):
        # Idle sequences must be freed even when no request arrives to trigger execute().
        interval = min(1.0, max(self.idle_timeout_s / 4, 0.05))
        while not self._stop.wait(interval):
            try:
                with self.lock:
                    if self.seqs.reap_idle(time.monotonic()):
                        self._update_active()
            except Exception:  # never let the reaper die silently
                self._log("error", "flashmap_target reaper: " + traceback.format_exc())

    # ------------------------------------------------------------------ requests

    def execute(self, requests):
        self._jobs.put((requests, time.perf_counter()))
        return None  # decoupled: the worker answers each request

    def _work_loop(self):
        if why := pin_worker(
            self.cpus, "worker"
        ):  # a CPU outside the container's set: run unpinned, say so
            self._log("warn", f"flashmap_target: {why}")
        while True:
            try:
                job = self._jobs.get(timeout=self.metrics.wait_s())
            except queue.Empty:  # nothing to run: time to send what is recorded
                job = ()
            if job is None:
                break
            try:
                if job:
                    self._run_job(*job)
                self.metrics.flush()
            except BaseException:  # the worker outlives any one batch: later requests are served
                self._log("error", "flashmap_target worker: " + traceback.format_exc())
        # What is still recorded is not sent: the model's metrics go with it, and a call into
        # a stub that is shutting down is one more thing the unload would wait on.

    def _run_job(self, requests, t_queued: float) -> None:
        # Answers go out from this thread, before the next batch: a second Python thread sending
        # them while the next forward ran was tried, and gained nothing.
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            with self.lock:
                responses = self._execute(requests)
        except Exception as e:  # never leave a request unanswered
            self._log("error", "flashmap_target: " + traceback.format_exc())
            responses = [
                _error(f"internal error: {type(e).__name__}: {e}", target_wire.ROW_INTERNAL)
            ] * len(requests)
        t1 = time.perf_counter()
        for request, response in zip(requests, responses):
            try:
                request.get_response_sender().send(response, flags=final)
            except Exception:  # a client gone away must not stop the others' answers
                self._log("error", "flashmap_target send: " + traceback.format_exc())
        self.metrics.inc("flashmap_target_batches_total")
        self.metrics.inc("flashmap_target_batch_wait_seconds_total", t0 - t_queued)
        t2, cpu2 = time.perf_counter(), time.thread_time()
        self.metrics.inc("flashmap_target_batch_run_seconds_total", t2 - t0)
        self.metrics.inc("flashmap_target_batch_answer_seconds_total", t2 - t1)
        self.metrics.inc("flashmap_target_batch_cpu_seconds_total", cpu2 - cpu0)

    def _execute(self, requests):
        """Every row of every request (a one-row request, or each row of a packed round) is
        admitted on its own; the admitted rows that are not trees share one forward."""
        now = time.monotonic()
        if self.seqs.reap_idle(now):
            self._update_active()
        responses = [None] * len(requests)
        packed: dict[int, list] = {}  # request index -> outcome per row of its ROWS
        outcome = {}  # (request index, row index or None) -> ("ok", result, path) | ("released",) | error
        rows, trees = [], []  # (key, corrid, end, row)
        queued: set[int] = set()  # correlation ids with a row in rows or trees

        def admit(key, corrid, start, end, row):
            if corrid in queued:  # this sequence's earlier row runs first
                self._forward(rows, trees, outcome)
                rows.clear()
                trees.clear()
                queued.clear()
            queued.add(corrid)
            done = self.seqs.admit(corrid, start, end, row, now)
            if done is not None:
                outcome[key] = done
            elif row.is_tree:
                trees.append((key, corrid, end, row))
            else:
                rows.append((key, corrid, end, row))

        for i, request in enumerate(requests):
            try:
                blob = pb_utils.get_input_tensor_by_name(request, "ROWS")
                if blob is not None:
                    items = target_wire.parse_packed_round(_single_bytes(blob.as_numpy()))
                    packed[i] = [None] * len(items)
                    for j, (corrid, start, end, get) in enumerate(items):
                        try:
                            admit((i, j), corrid, start, end, target_wire.parse_verify_inputs(get))
                        except InvalidRequest as e:
                            outcome[(i, j)] = (target_wire.ROW_INVALID, str(e))
                    continue
                kind, corrid, start, end, row = self._parse(request)
                if kind == "info":
                    out = np.array([[self.info_bytes]], dtype=np.object_)
                    responses[i] = pb_utils.InferenceResponse([pb_utils.Tensor("INFO_JSON", out)])
                    continue
                admit((i, None), corrid, start, end, row)
            except InvalidRequest as e:
                responses[i] = _error(str(e), target_wire.ROW_INVALID)
                packed.pop(i, None)  # the whole request failed: no row answers of its own
            except Exception as e:
                self._log("error", "flashmap_target: " + traceback.format_exc())
                responses[i] = _error(
                    f"internal error: {type(e).__name__}: {e}", target_wire.ROW_INTERNAL
                )
                packed.pop(i, None)

        self._forward(rows, trees, outcome)
        self._update_active()
        for (i, j), o in outcome.items():
            if j is None:
                responses[i] = self._one_row_response(o)
            elif i in packed:
                packed[i][j] = o
        for i, outs in packed.items():
            blob = target_wire.packed_outputs([self._row_outputs(o) for o in outs])
            responses[i] = pb_utils.InferenceResponse(
                [pb_utils.Tensor("ROWS_OUT", np.array([[blob]], np.object_))]
            )
        # Triton needs one response per request; none is left empty above, but never crash on it.
        return [
            r if r is not None else _error("no response", target_wire.ROW_INTERNAL)
            for r in responses
        ]

    def _forward(self, rows, trees, outcome) -> None:
        """Verify the admitted rows (one forward) and trees; their outcomes into `outcome`."""
        if rows:
            results = self._verify([r for _, _, _, r in rows])
            self.metrics.inc("flashmap_target_verify_batches_total")
            self.metrics.inc("flashmap_target_verify_rows_total", len(rows))
            self.metrics.set("flashmap_target_batch_size", len(rows))
            for (key, corrid, end, row), result in zip(rows, results):
                outcome[key] = result
                self.seqs.verified(corrid, row, result)
                if end:
                    self.seqs.release(corrid)
        if trees:
            results = self._verify_trees([r for _, _, _, r in trees])
            self.metrics.inc("flashmap_target_verify_batches_total")
            self.metrics.inc("flashmap_target_verify_rows_total", len(trees))
            for (key, corrid, end, _), result in zip(trees, results):
                outcome[key] = result
                self.seqs.follow.pop(corrid, None)
                if end:
                    self.seqs.release(corrid)

    def _verify(self, rows):
        """One forward for all rows; if the engine rejects the batch, find the bad rows alone.
        Per row ("ok", result, None) or (error code, message)."""
        try:
            return [("ok", r, None) for r in self.engine.verify(rows)]
        except InvalidRequest as e:
            if len(rows) == 1:
                return [(target_wire.ROW_INVALID, str(e))]
        except Exception as e:
            self._log("error", "flashmap_target verify: " + traceback.format_exc())
            return [(target_wire.ROW_INTERNAL, f"internal error: {type(e).__name__}: {e}")] * len(
                rows
            )
        # Rare path (a bad request in a batch): verify one by one so the others still succeed.
        return [self._verify([row])[0] for row in rows]

    def _verify_trees(self, rows):
        """One forward for all tree rows; if the engine rejects the batch, each row alone.
        Per row ("ok", result, path) or (error code, message)."""
        try:
            return [("ok", r, path) for r, path in self.engine.verify_trees(rows)]
        except InvalidRequest as e:
            if len(rows) == 1:
                return [(target_wire.ROW_INVALID, str(e))]
        except Exception as e:
            self._log("error", "flashmap_target verify_trees: " + traceback.format_exc())
            return [(target_wire.ROW_INTERNAL, f"internal error: {type(e).__name__}: {e}")] * len(
                rows
            )
        return [self._verify_trees([row])[0] for row in rows]

    def _row_outputs(self, o):
        if o[0] == "ok":
            return target_wire.verify_outputs(o[1], o[2], self.features_np_dtype)
        if o[0] == "released":
            return target_wire.empty_outputs(self.engine.feature_dim, self.features_np_dtype)
        return (o[0], re.sub(r"^row \d+: ", "", o[1]))

    def _one_row_response(self, o):
        out = self._row_outputs(o)
        if isinstance(out, dict):
            return pb_utils.InferenceResponse([pb_utils.Tensor(n, a) for n, a in out.items()])
        return _error(out[1], out[0])

    def _parse(self, request):
        """-> (kind, corrid, start, end, VerifyRow | None); raises InvalidRequest."""

        def get(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        corrid = int(target_wire.scalar(get, "CORRID", 0))
        if corrid == 0:
            corrid = int(request.correlation_id())
        start = bool(target_wire.scalar(get, "START", 0))
        end = bool(target_wire.scalar(get, "END", 0))
        if bool(target_wire.scalar(get, "INFO", False)):
            return "info", corrid, start, end, None
        return "verify", corrid, start, end, target_wire.parse_verify_inputs(get)

    def finalize(self):
        # Triton exits with an error once the unload takes --exit-timeout-secs (15 s, launcher).
        # Should it stall, every thread's stack goes to the server's log first, and the worker
        # (stuck in a stub call that never returns) gets a bounded wait.
        faulthandler.dump_traceback_later(FINALIZE_DUMP_S, file=sys.stderr)
        self._jobs.put(None)  # the worker answers what is queued first
        self._worker.join(timeout=5)
        self._stop.set()
        self._reaper.join(timeout=2)
        with self.lock:
            self.seqs.release_all()
        # Not cancelled: a stub still not gone FINALIZE_DUMP_S after this began dumps too (Python's exit cancels it).


# ---------------------------------------------------------------------- helpers


def _triton_code(row_code: int):
    # pb_utils.TritonError exists only once the stub runs the model, not at import.
    e = pb_utils.TritonError
    return {target_wire.ROW_INVALID: e.INVALID_ARG, target_wire.ROW_UNAVAILABLE: e.UNAVAILABLE}.get(
        row_code, e.INTERNAL
    )


def _single_bytes(a) -> bytes:
    a = np.asarray(a).reshape(-1)
    if a.size != 1:
        raise InvalidRequest(f"ROWS: expected one bytes value, got {a.size}")
    v = a[0]
    return v if isinstance(v, bytes) else bytes(v)


def _error(message: str, row_code: int) -> pb_utils.InferenceResponse:
    # Each response answers one row: the engine's "row N: " prefix would only confuse. A gRPC
    # stream carries an error's message but not its code: the message leads with it (target_wire.tag_error).
    message = target_wire.tag_error(row_code, re.sub(r"^row \d+: ", "", message))
    return pb_utils.InferenceResponse(
        output_tensors=[], error=pb_utils.TritonError(message, _triton_code(row_code))
    )
