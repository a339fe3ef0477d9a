// C++ helpers for the GPT dataset index (built by `pip install -e .` as megatron.data.helpers).
//
// build_sample_idx:        where each training sample starts, as (doc_idx position, token offset)
// build_blending_indices:  which dataset, and which of its samples, each blended sample comes from
//
// Both loops are O(samples) and run without the GIL; the Python side in
// megatron/data/gpt_dataset.py and megatron/data/blendable_dataset.py documents the semantics.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// Sample i covers tokens [start_i, start_{i+1}] (inclusive: seq_length + 1 tokens, the last one
// being the first token of the next sample). Row i of the result holds start_i as
// (position in doc_idx, offset inside that document).
template <typename T>
py::array_t<T> build_sample_idx_impl(const py::array_t<int32_t, py::array::c_style>& sizes,
                                     const py::array_t<int32_t, py::array::c_style>& doc_idx,
                                     int64_t seq_length, int64_t num_epochs,
                                     int64_t tokens_per_epoch) {
  const int32_t* sizes_ptr = sizes.data();
  const int32_t* doc_idx_ptr = doc_idx.data();
  const int64_t num_sizes = sizes.shape(0);
  const int64_t num_doc_idx = doc_idx.shape(0);
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;

  py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
  T* out = result.mutable_data();
  std::string error;
  {
    py::gil_scoped_release release;
    int64_t doc_idx_index = 0;
    int64_t doc_offset = 0;
    out[0] = 0;
    out[1] = 0;
    for (int64_t sample = 1; sample <= num_samples && error.empty(); ++sample) {
      int64_t remaining = seq_length + 1;
      while (remaining != 0) {
        if (doc_idx_index >= num_doc_idx) {
          error = "build_sample_idx: doc_idx ran out after " + std::to_string(sample - 1) +
                  " samples; tokens_per_epoch does not match sizes[doc_idx]";
          break;
        }
        const int64_t doc_id = doc_idx_ptr[doc_idx_index];
        if (doc_id < 0 || doc_id >= num_sizes) {
          error = "build_sample_idx: doc_idx holds document " + std::to_string(doc_id) +
                  " but there are only " + std::to_string(num_sizes) + " documents";
          break;
        }
        const int64_t doc_length = sizes_ptr[doc_id] - doc_offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          // The sample ends inside this document; the next one starts at its last token.
          doc_offset += remaining + doc_length - 1;
          remaining = 0;
        } else {
          ++doc_idx_index;
          doc_offset = 0;
        }
      }
      out[2 * sample] = static_cast<T>(doc_idx_index);
      out[2 * sample + 1] = static_cast<T>(doc_offset);
    }
  }
  if (!error.empty()) throw py::value_error(error);
  return result;
}

}  // namespace

// int32 rows when every position fits (as Megatron stores them), int64 otherwise.
py::array build_sample_idx(const py::array_t<int32_t, py::array::c_style>& sizes,
                           const py::array_t<int32_t, py::array::c_style>& doc_idx,
                           int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch) {
  if (seq_length <= 0) throw py::value_error("build_sample_idx: seq_length must be positive");
  if (num_epochs <= 0 || tokens_per_epoch <= 0)
    throw py::value_error("build_sample_idx: num_epochs and tokens_per_epoch must be positive");
  if (doc_idx.shape(0) < std::numeric_limits<int32_t>::max())
    return build_sample_idx_impl<int32_t>(sizes, doc_idx, seq_length, num_epochs,
                                          tokens_per_epoch);
  return build_sample_idx_impl<int64_t>(sizes, doc_idx, seq_length, num_epochs,
                                        tokens_per_epoch);
}

// Greedy blending (Megatron's rule): sample i goes to the dataset whose realised count lags
// its target weight * i the most (ties go to the lowest dataset index), so every prefix of
// the blend stays within a sample or two of the weights.
void build_blending_indices(py::array_t<uint8_t, py::array::c_style>& dataset_index,
                            py::array_t<int64_t, py::array::c_style>& dataset_sample_index,
                            const py::array_t<double, py::array::c_style>& weights,
                            int32_t num_datasets, int64_t size, bool verbose) {
  if (num_datasets <= 0 || num_datasets > 255)
    throw py::value_error("build_blending_indices: between 1 and 255 datasets are supported");
  if (weights.shape(0) != num_datasets || dataset_index.shape(0) < size ||
      dataset_sample_index.shape(0) < size)
    throw py::value_error("build_blending_indices: array sizes do not match");
  uint8_t* index_ptr = dataset_index.mutable_data();
  int64_t* sample_ptr = dataset_sample_index.mutable_data();
  const double* weights_ptr = weights.data();
  std::vector<int64_t> current(num_datasets, 0);
  {
    py::gil_scoped_release release;
    for (int64_t sample = 0; sample < size; ++sample) {
      const double position = std::max(static_cast<double>(sample), 1.0);
      int32_t best = 0;
      double best_error = weights_ptr[0] * position - static_cast<double>(current[0]);
      for (int32_t d = 1; d < num_datasets; ++d) {
        const double error = weights_ptr[d] * position - static_cast<double>(current[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      index_ptr[sample] = static_cast<uint8_t>(best);
      sample_ptr[sample] = current[best];
      current[best] += 1;
    }
  }
  if (verbose) {
    py::print(" > blended dataset sample ratios:");
    for (int32_t d = 0; d < num_datasets; ++d) {
      const double achieved = size > 0 ? static_cast<double>(current[d]) / size : 0.0;
      py::print("   dataset", d, "weight:", weights_ptr[d], "achieved:", achieved);
    }
  }
}

PYBIND11_MODULE(helpers, m) {
  m.doc() = "C++ index builders for the GPT and blended datasets";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        "Start (doc_idx position, offset) of each seq_length+1-token sample; shape [n+1, 2].");
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index").noconvert(),
        py::arg("dataset_sample_index").noconvert(), py::arg("weights"), py::arg("num_datasets"),
        py::arg("size"), py::arg("verbose"),
        "Fill dataset_index / dataset_sample_index so the blend follows the weights.");
}
