#pragma once

#include <CLI/CLI.hpp>

namespace colibri_cli {

struct CacheFlags;
// --max-resident, --eviction, --io-threads, --io-engine, --buffered-io, --no-speculate
// (common.h's CacheFlags) on a command that opens a model.
void add_cache_flags(CLI::App* command, CacheFlags* flags);

// Each adds its subcommand(s) to the app; the command runs from the
// subcommand's callback and reports failure by throwing CliError.
void add_model_commands(CLI::App& app);  // gen, verify, info
void add_route_commands(CLI::App& app);  // route compile, route dump
void add_run_commands(CLI::App& app);    // infer, bench, demo
void add_convert_commands(CLI::App& app);  // convert (Hugging Face checkpoints), quantize
void add_load_commands(CLI::App& app);     // loadtest

}  // namespace colibri_cli
