"""The launch script read as bash runs it: control flow, defaults, arithmetic and `"$@"`.

The reference is bash itself: each script runs under bash with `torchrun` replaced by a function
that prints the program's arguments, one per line, and import-config's reading must give the
same words. Where a value depends on what cannot be known without running the job (a loop, a
`case`, an undefined variable), the reading must leave it unresolved (an error naming it), never
a value bash would not have given."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from bloomtrain.errors import UserError
from bloomtrain.import_config.bash import read_launch, show, unresolved_in
from bloomtrain.import_config.megatron_args import parse_argv

# torchrun's options skipped, its program dropped, the program's arguments printed.
_STUB = ("torchrun() { while [[ $1 == --* ]]; do shift 2; done; shift; "
         "printf '%s\\n' \"$@\"; }\n")

DECIDED = {
    # Bash arrays, as Megatron-LM's own example scripts build their arguments.
    "arrays": 'L=2\nGPT_ARGS=(\n    --num-layers $L  # a comment\n    --pp-partition-method '
              '"type:transformer|embedding"\n    --seed 1\n)\nGPT_ARGS+=(--lr 1e-4)\n'
              'torchrun pretrain_gpt.py ${GPT_ARGS[@]} --save x "${GPT_ARGS[*]}"',
    "quoted_array": 'A=(--seed "1" --data-path "0.5 a" "0.5 b")\n'
                    'torchrun pretrain_gpt.py "${A[@]}"',
    "if_else": 'TESTING=0\nif [[ ${TESTING} == 1 ]]; then\n  L=2\nelse\n  L=24\nfi\n'
               'torchrun pretrain_gpt.py --num-layers $L',
    "elif": 'R=2\nif [ "$R" = 1 ]; then L=1\nelif [ "$R" -eq 2 ]; then L=2\nelse L=3\nfi\n'
            'torchrun pretrain_gpt.py --num-layers $L',
    "flag_block": 'ckpt="false"\nopts="--seed 1"\nif [ "${ckpt}" = "true" ]; then\n'
                  '  opts+=" --checkpoint-activations"\nfi\ntorchrun pretrain_gpt.py ${opts}',
    "one_line_if": 'TP=1\nif true; then TP=2; fi\n'
                   'torchrun pretrain_gpt.py --tensor-model-parallel-size $TP',
    "and_or": 'BIG=\nTP=2\n[ -n "$BIG" ] && TP=8\n[ -z "$BIG" ] || TP=16\n'
              'torchrun pretrain_gpt.py --tensor-model-parallel-size $TP',
    "negated": 'Z=3\nif ! [ "$Z" -gt 2 ]; then Z=0; fi\ntorchrun pretrain_gpt.py --seed $Z',
    "chain_newline": 'A=1\ntrue &&\n  A=2\nfalse && A=3\ntorchrun pretrain_gpt.py --seed $A',
    "nested_if": 'A=1; B=0\nif [ $A = 1 ]; then\n  if [ $B = 1 ]; then S=11; else S=10; fi\n'
                 'else S=0\nfi\ntorchrun pretrain_gpt.py --seed $S',
    "prefix_assignment": 'TP=2\nTP=8 true\ntorchrun pretrain_gpt.py --tensor-model-parallel-size $TP',
    "assign_default": ': ${SEED:=7}\ntorchrun pretrain_gpt.py --seed $SEED',
    "dash_default": 'SEED=\ntorchrun pretrain_gpt.py --seed "${SEED-1234}x" --lr ${SEED:-5}',
    "arithmetic": 'N=$((2**3))\nM=$(( -7 / 2 ))\nK=$(( -7 % 3 ))\n'
                  'torchrun pretrain_gpt.py --micro-batch-size $N --seed $M --lr $K',
    "no_script_arguments": 'torchrun pretrain_gpt.py "$@" --seed 1 $@ $*',
}


def _bash_argv(script: str) -> list[str]:
    out = subprocess.run(["bash", "-c", _STUB + script], capture_output=True, text=True,
                         check=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("name", sorted(DECIDED))
def test_a_decided_script_gives_the_words_bash_gives(name):
    assert shutil.which("bash"), "bash is the reference"
    script = DECIDED[name]
    assert [show(w) for w in read_launch(script).argv] == _bash_argv(script)


UNDECIDED = {
    # (script, the variable left unresolved)
    "case": ('MODE=small\ncase $MODE in\n  small) L=2;;\n  big) L=70;;\nesac\n'
             'torchrun pretrain_gpt.py --num-layers $L', "$L"),
    "loop": ('A=""\nfor x in 1 2; do A="$A --seed $x"; done\ntorchrun pretrain_gpt.py $A', "$A"),
    "environment": ('TP=2\n[ -n "$BIG" ] && TP=8\n'
                    'torchrun pretrain_gpt.py --tensor-model-parallel-size $TP', "$TP"),
    "file_test": ('TP=2\nif [ -f /etc/bigger ]; then TP=8; fi\n'
                  'torchrun pretrain_gpt.py --tensor-model-parallel-size $TP', "$TP"),
}


@pytest.mark.parametrize("name", sorted(UNDECIDED))
def test_an_undecided_condition_leaves_its_variables_unknown(name):
    script, variable = UNDECIDED[name]
    assert unresolved_in(read_launch(script).argv) == variable
    # An assignment that changes nothing under the condition leaves the value known.
    same = 'TP=2\nif [ -f /etc/x ]; then TP=2; fi\ntorchrun pretrain_gpt.py --seed $TP'
    assert read_launch(same).argv == ["--seed", "2"]
    # --var decides it.
    name_only = variable[1:]
    value = read_launch(script, {name_only: "--seed 3" if name == "loop" else "4"}).argv
    assert unresolved_in(value) is None


def test_a_launch_built_under_a_loop_names_the_variables_to_give():
    # As BigScience's tr7b-extrapolation-law.slurm: the launcher itself is set in the loop.
    script = ('for n in 1 2; do\n  LAUNCHER="torchrun --nnodes $n"\n'
              '  srun bash -c "$LAUNCHER pretrain_gpt.py --seed 1"\ndone\n')
    with pytest.raises(UserError, match=r"found no launch.*give them with --var: LAUNCHER "
                                        r"\(line 2\)"):
        read_launch(script)


def test_srun_running_a_shell_starts_its_tasks():
    # Megatron-DeepSpeed's examples/pretrain_gpt3_175B.sh: srun hands python to `sh -c`.
    script = ('#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=8\n'
              'run_cmd="python -u pretrain_gpt.py --seed 1"\nsrun -l sh -c "${run_cmd}"\n')
    launch = read_launch(script)
    assert (launch.world_size, launch.argv) == (16, ["--seed", "1"])
    assert read_launch(script.replace('srun -l sh -c "${run_cmd}"',
                                      'sh -c "${run_cmd}"')).world_size == 1


CHANGED = {
    # Commands that change a variable without NAME=VALUE: read as bash reads `unset`, the rest
    # left unknown (they kept the old value, 16, where bash has 32).
    "let": "let GBS=GBS*2", "let_quoted": 'let "GBS += 16"', "arith": "((GBS*=2))",
    "arith_spaced": "(( GBS = GBS * 2 ))", "arith_increment": "(( ++GBS, GBS += 15 ))",
    "printf_v": "printf -v GBS %d 32", "read": "read -r -p x GBS REST <<< '32 1'",
    "mapfile": "mapfile -t GBS <<< 32",
}


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_a_variable_changed_by_a_command_is_unknown_and_unset_is_read(name):
    script = f"GBS=16\n{CHANGED[name]}\ntorchrun pretrain_gpt.py --global-batch-size $GBS"
    assert _bash_argv(script)[-1] == "32"
    assert unresolved_in(read_launch(script).argv) == "$GBS"
    assert read_launch(script, {"GBS": "32"}).argv[-1] == "32"
    unset = "GBS=16\nunset GBS\ntorchrun pretrain_gpt.py --global-batch-size ${GBS:-32}"
    assert read_launch(unset).argv == _bash_argv(unset) == ["--global-batch-size", "32"]
    # A comparison assigns nothing.
    assert read_launch("GBS=16\n(( GBS >= 2 && GBS != 3 ))\ntorchrun pretrain_gpt.py "
                       "--global-batch-size $GBS").argv[-1] == "16"


def test_launcher_options_in_an_array_give_the_world_and_an_undecided_one_is_unknown():
    # Megatron-LM's examples: DISTRIBUTED_ARGS=( ... ); torchrun ${DISTRIBUTED_ARGS[@]} ...
    # The array was an error blaming 'pretrain_gpt.py'.
    script = ('DISTRIBUTED_ARGS=(\n  --nproc_per_node 8\n  --nnodes 2\n)\n'
              'ARGS=(--seed 1)\n[ -f /etc/big ] && ARGS=(--seed 2)\n'
              'torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${ARGS[@]}')
    launch = read_launch(script)
    assert launch.world_size == 16 and unresolved_in(launch.argv) == "$ARGS"
    assert read_launch(script.replace("[ -f /etc/big ] && ", "")).argv == ["--seed", "2"]
    assert read_launch(script, {"ARGS": "--seed 3"}).argv == ["--seed", "3"]


def test_a_var_that_changes_nothing_is_said():
    script = 'TP_SIZE=4\nL=${LAYERS:-2}\ntorchrun pretrain_gpt.py --num-layers $L --seed $TP_SIZE'
    launch = read_launch(script, {"TP_SIZE": "2", "TYPO_VAR": "1", "LAYERS": "3"})
    assert launch.argv == ["--num-layers", "3", "--seed", "4"]
    assert launch.unused_vars == [
        "--var TP_SIZE: the script sets TP_SIZE itself (line 1), and uses its own value",
        "--var TYPO_VAR: the script never reads TYPO_VAR"]


def test_arithmetic_reads_a_set_empty_variable_as_zero_and_names_an_unset_one():
    script = 'EXTRA=""\ntorchrun pretrain_gpt.py --seed $(( 8 + EXTRA )) --num-layers $((N+1))'
    argv = read_launch(script).argv
    assert argv[:2] == _bash_argv(script)[:2] == ["--seed", "8"]
    assert unresolved_in(argv) == "$N"  # not set in the script: the environment's, unknown
    with pytest.raises(UserError, match=r"not one of Megatron.s options \(it spells it "
                                        r"--tensor-model-parallel-size\)"):
        parse_argv(read_launch("torchrun pretrain_gpt.py --tensor_model_parallel_size 2").argv)


@pytest.mark.parametrize("starter,world", [
    ("srun --ntasks=16", 16), ("srun -n 16", 16), ("srun -n16 -l", 16),
    ("srun --nodes=2 --ntasks-per-node=8", 16), ("srun -N 2", 16), ("srun --ntasks-per-node=2", 8),
    ("srun --kill-on-bad-exit=1", 32), ("srun -n $NT", None),
    ("mpirun -np 16", 16), ("mpiexec -n 12 --bind-to none", 12), ("mpirun --hostfile h", None),
])
def test_srun_and_mpi_task_options_set_the_world_over_the_allocation(starter, world):
    # srun's own counts override the #SBATCH ones (a 4 x 8-task allocation here); mpirun and
    # mpiexec start -n/-np processes, and were read as one process.
    script = ('#!/bin/bash\n#SBATCH --nodes=4\n#SBATCH --ntasks-per-node=8\n'
              f'{starter} python pretrain_gpt.py --seed 1\n')
    launch = read_launch(script)
    assert launch.world_size == world, launch.world_note
    assert read_launch(script.replace(starter, f'{starter} bash -c "', 1).replace(
        "--seed 1\n", '--seed 1"\n')).world_size == world


def test_an_unset_variable_among_the_arguments_is_named_as_the_script_spells_it():
    argv = read_launch("torchrun pretrain_gpt.py --num-layers 2 $EXTRA_ARGS").argv
    with pytest.raises(UserError, match=r"got 2: \['2', '\$EXTRA_ARGS'\]; \$EXTRA_ARGS is not "
                                        r"known .* pass --var EXTRA_ARGS=VALUE \(an empty"):
        parse_argv(argv)
    assert read_launch("torchrun pretrain_gpt.py --num-layers 2 $EXTRA_ARGS",
                       {"EXTRA_ARGS": ""}).argv == ["--num-layers", "2"]
