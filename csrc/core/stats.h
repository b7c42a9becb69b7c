// torch_ipc.stats(): every counter of this process, named and described once
// here; the binding and the Python docstring are made from this list.
#pragma once

#include <cstdint>
#include <variant>
#include <vector>

#include "core/export.h"

namespace torch_ipc {

struct StatField {
  const char* name;
  int64_t value;
  const char* doc;    // one line for stats()'s docstring
  bool flag = false;  // a yes/no: stats() shows it as a bool
};

// The counters, in the order stats() shows them; value 0 when asked for docs only.
std::vector<StatField> process_stats(bool with_values = true);

// The fields of each stats()["oldest_exports"] entry (PinnedExport).
struct PinnedField {
  const char* name;
  const char* doc;
};
const std::vector<PinnedField>& pinned_export_fields();
std::vector<std::variant<int64_t, double>> pinned_export_values(const PinnedExport& p);  // in that order

}  // namespace torch_ipc
