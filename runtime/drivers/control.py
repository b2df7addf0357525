"""The control protocol between the rank processes of one launch (meta["t"] of a meta-only message).

Control messages share the data transport (runtime/transport/zmq_dist.py) with the expert rows: they carry no tensor
and reach the driver through `engine.on_control`. Rank 0 is the coordinator (runtime/drivers/coordinator.py): it
alone owns the request list and the arrival times, picks each request's home, and collects the finished requests.

  ready  rank -> 0   weights loaded, engine built (startup barrier: a slow loader must not make the
                     first requests look slow)
  sync   0 -> rank   the coordinator's clock reading: every rank offsets its clock to it, so arrival,
                     admission and finish times are on one time base (exact on one host, within one
                     one-way latency across hosts)
  synced rank -> 0   clock shifted; the coordinator admits nothing before every rank said so (a rank
                     must not time-stamp expert rows from a faster peer on its old time base)
  adm    0 -> home   a request (runtime/drivers/admission.py request_to_wire: plain values) for workload w
  cancel 0 -> home   a served request's client went away: finish it at its next token
  fin    home -> 0   a finished request: tokens, finish reason, times, home's free blocks and tokens
  stop   0 -> rank   every request of workload w finished: report and move on
  done   rank -> 0   this rank's metrics (and trace) of workload w; it is idle

When every request of a workload finished, no data message of it can still be in flight (a request samples its last
token only after all its expert rows came back), so `stop` is a clean cut and the next workload's engine can start on
the same transport.
"""
from __future__ import annotations

CTRL_READY, CTRL_SYNC, CTRL_SYNCED = "ready", "sync", "synced"
CTRL_ADMIT, CTRL_FIN, CTRL_STOP, CTRL_DONE = "adm", "fin", "stop", "done"
CTRL_CANCEL = "cancel"
COORDINATOR = 0  # the rank that coordinates (and serves, like every other)
