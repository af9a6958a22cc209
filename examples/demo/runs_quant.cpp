// kvcache_demo's TTFT and tier runs on q8_0 and q4_0 K/V (runs.hpp; one source for the two,
// as in runs_16bit.cpp).
#include "runs_element.hpp"

KVCACHE_DEMO_ELEMENT_RUNS(kvcache::q8_0);
KVCACHE_DEMO_ELEMENT_RUNS(kvcache::q4_0);
