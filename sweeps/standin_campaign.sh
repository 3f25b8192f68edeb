#!/usr/bin/env bash
# The stand-in campaign (results/cifar10/CAMPAIGN.md): the paper's image protocol on CIFAR-10 at
# 30 epochs, through the repository's own sweeps and GPU pool (one job per GPU), phase by phase:
#
#   bash sweeps/standin_campaign.sh lr_tune table1_r18 table34 table1_r50 ablation table2
#   SEEDS=0,1,2 bash sweeps/standin_campaign.sh newcomers steptime  # today's optimizers
#   SEEDS=0,1 bash sweeps/standin_campaign.sh curvature_every   # Ginger tau=8, K=1,2,4,8; 10 epochs
#   SEEDS=0,1 bash sweeps/standin_campaign.sh time_to_accuracy  # K=1,4,8,16 and Adam; 30 epochs
#
# Every phase is a `make` target's sweep at SCALE=standin; completed runs are skipped, so a phase
# cut short is continued by running it again. Env: GINGER_DATA (the folder holding
# cifar10-jpeg.tar.xz and xsum-1000.jsonl; default .data), SEEDS (default 0; e.g. 0,1),
# PY (default python3), CAMPAIGN_ARGS (extra overrides for every job; default logger=none).
set -u
PY=${PY:-python3}
SEEDS=${SEEDS:-0}
EXTRA=${CAMPAIGN_ARGS:-logger=none}
# Longest jobs first (by measured time a step), so that the pool finishes sooner.
ARMS="qng_tau32,qng_tau16,ginger_tau32,qng_tau8,ginger_tau16,qng_tau4,qng_tau2,ginger_tau8"
ARMS="$ARMS,qng_tau1,ginger_tau4,ginger_tau2,ginger_tau1,adam,momentum"
NEWCOMERS="kfac,soap,muon,schedule_free_adamw"  # today's optimizers, longest first
# Unclipped Ginger's lr grid: the paper's {1, 5} x 10^{-1..-4} times 1e-4. Without the clip a
# direction outside span U moves by lr/gamma times the momentum (gamma = 1e-5), so lr/gamma spans
# 5 .. 1e-3 (Momentum's tuned lr is 0.05); the paper's grid would step by 1e1..1e4 per entry.
UNCLIPPED_LRS=5e-5,1e-5,5e-6,1e-6,5e-7,1e-7,5e-8,1e-8
pool() { $PY -m sweeps.gpu_pool -- scale=standin $EXTRA "$@"; }
status=0
for phase in "$@"; do
  echo "=== $(date -u +%FT%TZ) phase $phase (seeds $SEEDS)"
  case $phase in
    lr_tune)  # each ResNet on itself; Ginger's ResNet-50 grid also at 5e-5 and 1e-5 (its best
      # was the grid's smallest lr)
      pool +sweep=lr_tune "+sweep/exp=standin/cifar100_resnet18,standin/cifar100_resnet50" \
        +sweep/arm=qng,ginger,adam,momentum seed=0 \
        && pool +sweep=lr_tune +sweep/exp=standin/cifar100_resnet50 +sweep/arm=ginger \
          lr=5e-5,1e-5 seed=0 \
        && $PY -m sweeps.best_lr ;;
    newcomers)  # today's optimizers: their lrs on the paper's grid, Table 1 ResNet-18, then
      # ResNet-50 for the two fastest to the targets (Muon, schedule-free AdamW)
      pool +sweep=lr_tune +sweep/exp=standin/cifar100_resnet18 "+sweep/arm=$NEWCOMERS" seed=0 \
        && pool +sweep=lr_tune +sweep/exp=standin/cifar100_resnet50 \
          +sweep/arm=muon,schedule_free_adamw seed=0 \
        && $PY -m sweeps.best_lr \
        && pool +sweep=table1 +sweep/exp=standin/cifar100_resnet18 "+sweep/arm=$NEWCOMERS" \
          seed=$SEEDS \
        && pool +sweep=table1 +sweep/exp=standin/cifar100_resnet50 \
          +sweep/arm=muon,schedule_free_adamw seed=$SEEDS ;;
    steptime)  # every profiled optimizer 600 steps alone on both ResNets, Adam among them
      pool +sweep=steptime ;;
    table1_r18) pool +sweep=table1 +sweep/exp=standin/cifar100_resnet18 "+sweep/arm=$ARMS" seed=$SEEDS ;;
    table1_r50) pool +sweep=table1 +sweep/exp=standin/cifar100_resnet50 "+sweep/arm=$ARMS" seed=$SEEDS ;;
    table34)  # alpha 0.99 x tau 2, 4, 8 are table1_r18's Ginger runs (the same resolved config;
      # results/tables.py falls back to them), so only alpha 0.9 and 0.999 run here
      pool +sweep=table34 alpha=0.9,0.999 seed=$SEEDS ;;
    ablation)  # unclipped Ginger's own lr (best_lr's ginger_unclipped entry), then the variants
      # Table 1 lacks: rho 1 (clip) x per_tensor at tau 4 is table1_r18's ginger_tau4 run (the same
      # resolved config; results/tables.py's ablation table takes it as that row)
      pool +sweep=lr_tune +sweep/exp=standin/cifar100_resnet18 +sweep/arm=ginger rho=null \
        "lr=$UNCLIPPED_LRS" seed=0 && $PY -m sweeps.best_lr \
        && pool +sweep=ablation rho=null seed=$SEEDS \
        && pool +sweep=ablation rho=1.0 block=global seed=$SEEDS ;;
    table2) pool +sweep=table2 "+sweep/arm=$ARMS" seed=$SEEDS ;;
    curvature_every)  # the sweep lists its arms longest first (K = 1, 2, 4, 8, then Adam)
      pool +sweep=curvature_every seed=$SEEDS ;;
    time_to_accuracy)  # K = 1, 4, 8, 16 and Adam, Table 1's 30 epochs, one card kind
      pool +sweep=curvature_every epochs=30 "+sweep/arm=ginger_tau8,ginger_tau8_k4,ginger_tau8_k8,ginger_tau8_k16,adam" \
        seed=$SEEDS ;;
    *) echo "unknown phase $phase (lr_tune table1_r18 table1_r50 table34 ablation table2" \
      "curvature_every time_to_accuracy newcomers steptime)"; exit 2 ;;
  esac || status=1
done
echo "=== $(date -u +%FT%TZ) done (status $status)"
exit $status
