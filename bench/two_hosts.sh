# Sourced by the benchmark scripts that need two hosts: two network namespaces joined by a veth
# pair, each end shaped by tc tbf, and a helper that runs one `oxcomm launch` per namespace.
# Needs root. Expects OXCOMM (the binary) and OUT (a directory) to be set by the caller.
#
#   two_hosts PREFIX NET RATE   creates ${PREFIX}0 and ${PREFIX}1 with addresses NET.1 and NET.2
#                               (e.g. 10.79.0), shapes both ends to RATE, removes them on exit,
#                               and exports a fresh OXCOMM_TOKEN.
#   on_two_hosts NAME NPROC PORT -- BENCH_ARGS...
#                               runs `oxcomm bench --worker BENCH_ARGS` with NPROC ranks per host;
#                               host 0's output goes to $OUT/NAME.txt, host 1's to $OUT/NAME_node1.txt.

two_hosts() {
    TWO_HOSTS_NS=$1
    TWO_HOSTS_NET=$2
    local rate=$3
    trap 'for i in 0 1; do ip netns del "$TWO_HOSTS_NS$i" 2>/dev/null || true; done' EXIT
    ip netns add "${TWO_HOSTS_NS}0"
    ip netns add "${TWO_HOSTS_NS}1"
    ip -n "${TWO_HOSTS_NS}0" link add eth0 type veth peer name eth0 netns "${TWO_HOSTS_NS}1"
    for i in 0 1; do
        ip -n "$TWO_HOSTS_NS$i" addr add "$TWO_HOSTS_NET.$((i + 1))/24" dev eth0
        ip -n "$TWO_HOSTS_NS$i" link set eth0 up
        ip -n "$TWO_HOSTS_NS$i" link set lo up
        ip netns exec "$TWO_HOSTS_NS$i" tc qdisc replace dev eth0 root tbf rate "$rate" burst 128k latency 20ms
    done
    export OXCOMM_TOKEN
    OXCOMM_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
}

on_two_hosts() {
    local name=$1 nproc=$2 port=$3
    shift 4 # NAME NPROC PORT --
    local launch=(launch --nnodes 2 --master-addr "$TWO_HOSTS_NET.1" --master-port "$port" -n "$nproc")
    ip netns exec "${TWO_HOSTS_NS}1" "$OXCOMM" "${launch[@]}" --node-rank 1 -- "$OXCOMM" bench --worker "$@" \
        >"$OUT/${name}_node1.txt" 2>&1 &
    local node1=$!
    ip netns exec "${TWO_HOSTS_NS}0" "$OXCOMM" "${launch[@]}" --node-rank 0 -- "$OXCOMM" bench --worker "$@" \
        >"$OUT/$name.txt" 2>&1 || { cat "$OUT/$name.txt" "$OUT/${name}_node1.txt" >&2; exit 1; }
    wait "$node1"
}
