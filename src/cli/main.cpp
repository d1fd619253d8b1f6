// The moekit command line: plan (the workspace per GPU), run (the layer over N ranks), bench (the
// layer's step time against the machine's ceilings).
// Exit codes: 0 success, 1 a moekit::Error (bad input: the message says what, the limit and the
// fix; --verbose adds where it was raised), 2 a usage error (a flag's value outside its range
// included), 3 a --check that failed its tolerance, 4 an internal error (a bug: never bad input).
#include <CLI/CLI.hpp>
#include <iostream>

#include "cli/commands.h"
#include "moekit/check.h"

int main(int argc, char** argv) {
  CLI::App app{"moekit: the Mixture-of-Experts layer of expert-parallel inference"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "moekit 0.2.0");
  bool verbose = false;
  app.add_flag("--verbose", verbose, "On an error, also print where it was raised (file, line, check)");
  std::vector<std::function<int()>> commands;
  commands.push_back(moekit::cli::add_plan_command(app));
  commands.push_back(moekit::cli::add_run_command(app));
  commands.push_back(moekit::cli::add_bench_command(app));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    for (auto& run : commands) {
      const int rc = run();
      if (rc >= 0) return rc;
    }
  } catch (const moekit::Error& e) {
    std::cerr << e.what() << "\n";
    if (verbose && !e.where().empty()) std::cerr << "  (raised at " << e.where() << ")\n";
    return 1;
  } catch (const std::exception& e) {
    // Not an input moekit refused by name: a check it lacks (memory it did not account for, a library
    // error it did not translate). Said as such, never an abort.
    std::cerr << "moekit: internal error (a bug: please report it with the command line): " << e.what() << "\n";
    return 4;
  }
  return 2;
}
