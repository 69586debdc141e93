#!/usr/bin/env python3
"""The checks pytorch_equivalence.sh and llama_equivalence.sh make of a run against its PyTorch reference.

  equivalence_checks.py losses METRICS_CSV REFERENCE_LOSSES_JSON
      every step's loss in metrics.csv equals the reference's to the 6 significant digits it prints
  equivalence_checks.py eval SUMMARY_JSON REFERENCE_EVAL_JSON
      the run's own final evaluation equals PyTorch's evaluation of its export within 1e-5
"""
import csv, json, sys


def losses(metrics, reference):
    rows = [r for r in csv.DictReader(open(metrics)) if r["loss"]]
    ref = json.load(open(reference))
    if [int(r["step"]) for r in rows] != list(range(1, len(ref) + 1)):
        sys.exit("logged steps %s, expected 1..%d" % ([r["step"] for r in rows], len(ref)))
    worst = max(abs(float(r["loss"]) - x) / abs(x) for r, x in zip(rows, ref))
    print("losses: %d steps, largest relative difference %.2g (printed to 6 digits)" % (len(ref), worst))
    return 0 if worst <= 5e-6 else 1


def evaluation(summary, reference_json):
    mine = json.load(open(summary))["test_loss"]
    theirs = json.loads(reference_json)["loss"]
    print("validation loss: fsdp-train %.8f, PyTorch on its export %.8f" % (mine, theirs))
    return 0 if abs(mine - theirs) <= 1e-5 * abs(theirs) else 1


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("losses", "eval"):
        sys.exit(__doc__)
    sys.exit((losses if sys.argv[1] == "losses" else evaluation)(sys.argv[2], sys.argv[3]))
