// The attention kernels every test executable of one flavour shares (kernel_instances.hpp).
#include "kernel_instances.hpp"

KVTEST_SHARED_KERNEL_ELEMENTS(KVCACHE_INSTANTIATE_ATTENTION)
