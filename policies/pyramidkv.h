// PyramidKV's per-layer share of a budget (see pyramidkv.cpp).
#pragma once

namespace kvsim {

int pyramid_budget(int budget, int layer, int num_layers, int ratio);

}  // namespace kvsim
