#!/bin/sh
# dualpath traffic manager (arXiv 2602.21548 §5) for RoCE (NVIDIA/Mellanox mlnx_qos): run per CNIC
# collectives: DSCP 26 -> priority 3 -> TC 3; KV traffic: DSCP 16 -> priority 2 -> TC 2 (ETS 1%)
# 4 lossless classes (PFC on priorities 0-3); switches need the same DSCP map,
# PFC and ETS weights on every port.
set -e
mlnx_qos -i ens1f0 --trust dscp
mlnx_qos -i ens1f0 --dscp2prio set,26,3
mlnx_qos -i ens1f0 --dscp2prio set,16,2
mlnx_qos -i ens1f0 --pfc 1,1,1,1,0,0,0,0
mlnx_qos -i ens1f0 --prio_tc 0,1,2,3,0,0,0,0
mlnx_qos -i ens1f0 --tsa ets,ets,ets,ets,ets,ets,ets,ets --tcbw 33,33,1,33,0,0,0,0
