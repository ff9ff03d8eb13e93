// colibri: command-line front end to libcolibri.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "common.h"

int main(int argc, char** argv) {
  CLI::App app{"colibri: low-latency CPU runtime for Mixture-of-Experts layers"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(colibri_version()));
  colibri_cli::add_model_commands(app);
  colibri_cli::add_route_commands(app);
  colibri_cli::add_run_commands(app);
  colibri_cli::add_convert_commands(app);
  colibri_cli::add_load_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const colibri_cli::CliError& e) {
    std::fprintf(stderr, "colibri: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri: %s\n", e.what());
    return 1;
  }
  return 0;
}
