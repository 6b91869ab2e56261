// The part of torch's C++ API the kernels use (tensors, dtypes, checks, ATen ops), without
// torch/extension.h's pybind11 and C++-frontend headers: a kernel file parses in ~13 s instead of
// ~50 on two cores, which is most of a fresh build (BENCHMARKS.md). Only bindings.cpp, which
// binds to Python, includes torch's pybind11 glue instead. The others include this first: the
// build compiles it once (kernels/pch.py), and GCC reads that only for a file's first include.
#pragma once

#include <ATen/ATen.h>

namespace torch {
using namespace at;  // torch::Tensor, torch::kBFloat16, torch::empty, ... as in extension code
}  // namespace torch
