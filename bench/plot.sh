#!/bin/sh
# Turns kvcache_bench JSON output into (1) a plot of bw_frac versus cached tokens for
# attn_decode, one line per element type and thread count, (2) when the JSON holds the
# serving-shaped rows, a bar plot of their vs_separate (<plot>_serving.<ext>), and (3)
# the markdown table of every kernel benchmark that bench/README.md shows (medians when
# the JSON holds repetition aggregates, plain runs otherwise).
#
# usage: bench/plot.sh results.json [plot.png|plot.svg] > table.md
# needs: jq and gnuplot (Debian: apt-get install jq gnuplot-nox)
set -eu
json=${1:?usage: bench/plot.sh results.json [plot.png|plot.svg]}
plot=${2:-attn_decode_bw_frac.png}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Rows to use, by name (interleaved repetitions leave them in random order): median
# aggregates if present, else iterations.
jq -r '
  (.benchmarks | map(select(.aggregate_name == "median")) | length) as $nmed
  | .benchmarks | sort_by(.run_name // .name) | .[]
  | select(if $nmed > 0 then .aggregate_name == "median" else .run_type == "iteration" end)
  | [(.run_name // .name), (.bw_frac // ""), (.peak_frac // ""), (.bytes_per_second // ""), (.["FLOP/s"] // ""), .real_time, .time_unit,
     (.vs_separate // ""), (.det_cost // ""), (.attn_tok_s_32l // "")]
  | @tsv' "$json" > "$tmp/rows.tsv"

# Plot data: attn_decode/<type>/n_kv:<n>/threads:<t> (the plain GQA case only).
awk -F'\t' '$1 ~ /^attn_decode\/[a-z0-9]+\/n_kv:[0-9]+\/threads:[0-9]+/ {
    split($1, p, "/"); n = p[3]; sub("n_kv:", "", n); t = p[4]; sub("threads:", "", t);
    print p[2] "_t" t, n, $2 }' "$tmp/rows.tsv" | sort -k1,1 -k2,2n > "$tmp/decode.dat"

if [ -s "$tmp/decode.dat" ]; then
  series=$(cut -d' ' -f1 "$tmp/decode.dat" | sort -u)
  cmd=""
  for s in $series; do
    grep "^$s " "$tmp/decode.dat" | cut -d' ' -f2,3 > "$tmp/$s.dat"
    label=$(echo "$s" | sed 's/_t/, threads /')
    cmd="$cmd${cmd:+, }'$tmp/$s.dat' using 1:2 with linespoints title '$label'"
  done
  case "$plot" in
    *.svg) term="svg size 800,500" ;;
    *) term="pngcairo size 800,500" ;;
  esac
  gnuplot -e "set terminal $term noenhanced; set output '$plot'; set logscale x 2; set xlabel 'cached tokens (n_kv)';
    set ylabel 'bw_frac (achieved / measured read bandwidth)'; set yrange [0:*]; set grid; set key bottom right;
    set title 'attn_decode: D=128, 32 q heads, 8 KV heads'; plot $cmd" 2>/dev/null ||
  gnuplot -e "set terminal ${term#pngcairo }; set output '$plot'; plot $cmd"
  echo "plot: $plot" >&2
fi

# Second plot: the serving-shaped rows (many sequences, shared prefixes, mixed calls), one
# bar per row: vs_separate = time of one call per sequence / time of the one call.
awk -F'\t' '$8 != "" { name = $1; sub("/real_time$", "", name); gsub("_", "-", name); print "\"" name "\" " $8 }' \
  "$tmp/rows.tsv" > "$tmp/serving.dat"
if [ -s "$tmp/serving.dat" ]; then
  splot="${plot%.*}_serving.${plot##*.}"
  case "$splot" in
    *.svg) term="svg size 900,500" ;;
    *) term="pngcairo size 900,500" ;;
  esac
  gnuplot -e "set terminal $term noenhanced; set output '$splot'; set style data histograms; set style fill solid 0.6;
    set boxwidth 0.8; set xtics rotate by -35 font ',8'; set ylabel 'vs_separate (separate calls / one call)';
    set yrange [0:*]; set grid y; set key off; set arrow from graph 0, first 1 to graph 1, first 1 nohead dt 2;
    set title 'serving-shaped attention rows (target >= 1)'; plot '$tmp/serving.dat' using 2:xtic(1)" &&
    echo "plot: $splot" >&2
fi

# Markdown table (vs_separate, det_cost and attention-only tokens/s of a 32-layer model
# where the row has them).
echo "| benchmark | bw_frac | peak_frac | GB/s | GFLOP/s | time | vs_separate | det_cost | attn tok/s (32 layers) |"
echo "|---|---|---|---|---|---|---|---|---|"
awk -F'\t' '{
    bw = ($2 == "") ? "" : sprintf("%.2f", $2);
    pk = ($3 == "") ? "" : sprintf("%.2f", $3);
    gb = ($4 == "") ? "" : sprintf("%.1f", $4 / 1e9);
    gf = ($5 == "") ? "" : sprintf("%.1f", $5 / 1e9);
    vs = ($8 == "") ? "" : sprintf("%.2f", $8);
    dc = ($9 == "") ? "" : sprintf("%.3f", $9);
    tk = ($10 == "") ? "" : sprintf("%.0f", $10);
    name = $1; sub("/real_time$", "", name);
    printf "| %s | %s | %s | %s | %s | %.3g %s | %s | %s | %s |\n", name, bw, pk, gb, gf, $6, $7, vs, dc, tk }' "$tmp/rows.tsv"
