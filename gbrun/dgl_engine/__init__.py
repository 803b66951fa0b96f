"""DGL's distributed engine (DistGraph, graph servers) under the example's
own run() and loop; imported by distributed/ and its tests only.

    partitions  the partitions as a data source (gbrun.sources): the
                DistGraph, each trainer's share of the splits, --predict's
                outputs in DistTensors
    loader      a trainer's mini-batches, in the shape GraphBolt hands the
                example (DistLoader)
    files       what partition_graph.py writes beside the partitions and
                the trainer reads (dataset_info.json, item sets, orig_nids)
    watch       processes that end when their job has failed: a graph
                server whose clients have gone, a trainer whose job cannot
                go on (TrainerWatch, reading its loader's Heartbeat)
    cleanup     what a failing process leaves: its samplers, the job's
                shared memory in /dev/shm
    machine     one machine's part of a job, started as DGL's
                tools/launch.py starts it
"""
