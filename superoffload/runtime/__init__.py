"""The offload engine (weight-stationary SuperOffload): hooks, lanes, STV, checkpoints.

Entry point: ``superoffload.initialize`` (``runtime.initialize``). See docs/engine.md.

Reading one step (``engine.backward``, ``engine.step``, ``engine.zero_grad``, the next
forward), file:function in the order it runs (docs/engine.md, "Reading one step"):

1. entry: engine.py:OffloadEngine.backward -> launch.py:check_backward;
   boundary.py:Boundary.at_boundary (a queued reconfigure, written weights: only when
   something happened);
2. freeze: boundary.py:Boundary.freeze -> frozen.py:FrozenIteration ->
   launch.py:Launcher.begin; at the last micro-step kernels/hyper.py:hypers_of,
   auto_rollback.py:check_rollback_mode, launch.py:Launcher.micro_step;
3. launch: launch.py:GradReady.__call__ -> Launcher.on_grad_ready -> Launcher._launch ->
   departures.py:Departures.depart -> local_transport.py:LocalTransport.launch ->
   copy_lanes.py:CopyLanes.launch -> transfers.py:D2HTask.run (d2h lane);
4. speculative step: steps.py:step_task -> iteration.py:Parts.submit ->
   lanes.py:ThreadLane.submit -> steps.py:StepTask.run (auto_rollback.py:AutoRollback.protect,
   state_overflow.py:may_overflow) -> steps.py:run_calls -> kernels/prepared.py;
5. publish: publishes.py:Publishes.publish -> local_transport.py:LocalTransport.publish ->
   copy_lanes.py:CopyLanes.publish -> transfers.py:H2DTask.run (h2d lane);
6. validate: optimizer.py:OffloadOptimizer.step -> stv.py:validate (LocalTransport.tail_stats
   -> CopyLanes.tail_stats, stv.py:host_overflow, contract.py:Contract.edited,
   LocalTransport.reduce_stats);
7. decide: stv.py:decide -> stv.py:verdict;
8. settle / rollback: stv.py:settle (stv.py:rollback -> steps.py:rollback_task, a replay's
   steps.py:step_task, the tail's steps.py:device_step);
9. close: stv.py:close_iteration (loss_scaler.py:LossScaler.update,
   stv.py:AdaptiveSTV.observe) -> launch.py:Launcher.next_iteration;
   optimizer.py:OffloadOptimizer.zero_grad;
10. next forward: publishes.py:Timeline.on_start -> publishes.py:WaitWeights.__call__ ->
    Publishes.wait_for_weights; synchronize: engine.py:OffloadEngine.drain.

The FSDP2 engine's step is this one with ``superoffload.distributed.fsdp``'s transport in
local_transport.py's place (the same copy_lanes.py; the transports share their parts, they do
not inherit) and FSDP2's unit hooks at the edge (docs/engine.md, "Reading one step").
"""
