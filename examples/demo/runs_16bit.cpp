// kvcache_demo's TTFT and tier runs on f16 and bf16 K/V (runs.hpp). The two elements share
// one source: a source of its own costs each ~30 s of compile time that the two share.
#include "runs_element.hpp"

KVCACHE_DEMO_ELEMENT_RUNS(kvcache::f16);
KVCACHE_DEMO_ELEMENT_RUNS(kvcache::bf16);
