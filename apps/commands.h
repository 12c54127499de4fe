// Subcommands of the iris binary. Each parses its own flags and returns the process exit code.
#pragma once

namespace iris {

int run_generate_command(int argc, char** argv);
int run_bench_command(int argc, char** argv);
// iris bench --train (dispatched by run_bench_command).
int run_bench_train(int argc, char** argv);
int run_train_command(int argc, char** argv);
int run_export_command(int argc, char** argv);
int run_data_command(int argc, char** argv);
int run_report_command(int argc, char** argv);

}  // namespace iris
